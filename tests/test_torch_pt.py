"""PyTorch .pt files (statekit.formats.torch_pt): reading torch's files, writing files torch reads.

The reference is torch itself: every readable fixture in fixtures/torch (copies of files torch
wrote) and fixtures/torch_extra (scripts/make_torch_fixtures.py) is compared element by element,
bit for bit, with ``torch.load(weights_only=True)`` of the same file; everything statekit writes
is loaded back with ``torch.load(weights_only=True)``, with and without ``mmap=True``.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import struct
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_torch_pickle import ExecCall, SystemCall, tensor_call, wrap

from statekit import dtypes
from statekit.errors import FormatError, MappingError, UnsafePickleError
from statekit.formats import torch_pickle, torch_pt
from statekit.formats.torch_pickle import STATEKIT_TO_TORCH, TorchDtype
from statekit.formats.torch_pt import is_pt, load_pt, save_pt, sniff_pt
from statekit.tensor import TensorRef

ALL_FIXTURES = sorted((FIXTURES / "torch").iterdir()) + sorted((FIXTURES / "torch_extra").iterdir())
REFUSED = {
    "broken.pt": "not a PyTorch file",
    "tar_weight_bias.tar": "pre-1.0 tar format",
    "complex.pt": "tensor dtype torch.complex64 is not supported",
    "quantized.pt": "tensor dtype torch.qint8 is not supported",
    "float8.pt": "tensor dtype torch.float8_e4m3fn is not supported",
}
READABLE = [p for p in ALL_FIXTURES if p.name not in REFUSED]
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fixture_id(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


# --------------------------------------------------------------------------------------------
# comparing with torch


def torch_bytes(tensor) -> bytes:
    return tensor.detach().reshape(-1).contiguous().view(__import__("torch").uint8).numpy().tobytes()


def assert_matches_torch(ours: object, ref: object, where: str = "top") -> None:
    """``ours`` (from load_pt) holds exactly what ``ref`` (from torch.load) holds."""
    torch = pytest.importorskip("torch")
    if isinstance(ref, torch.Tensor):
        assert isinstance(ours, TensorRef), where
        assert ours.info["torch_dtype"] == str(ref.dtype).removeprefix("torch."), where
        assert STATEKIT_TO_TORCH[ours.dtype] == ours.info["torch_dtype"], where
        assert ours.shape == tuple(ref.shape), where
        assert ours.info["parameter"] == isinstance(ref, torch.nn.Parameter), where
        assert ours.info["requires_grad"] == ref.requires_grad, where
        assert bytes(ours.raw()) == torch_bytes(ref), where
        values = ours.numpy()
        assert values.dtype == dtypes.numpy_dtype(ours.dtype) and values.shape == ours.shape, where
        assert np.ascontiguousarray(values).tobytes() == torch_bytes(ref), where
        attributes = {k: v for k, v in vars(ref).items() if not k.startswith("_")}
        assert ours.info.get("python_state", {}) == attributes, where
    elif isinstance(ref, torch.dtype):
        assert ours == TorchDtype(str(ref).removeprefix("torch.")), where
    elif isinstance(ref, dict):
        assert type(ours) is dict and list(ours) == list(ref), where
        for key in ref:
            assert_matches_torch(ours[key], ref[key], f"{where}[{key!r}]")
    elif isinstance(ref, list | tuple):
        assert type(ours) is (tuple if isinstance(ref, torch.Size) else type(ref)), where
        assert len(ours) == len(ref), where
        for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
            assert_matches_torch(a, b, f"{where}[{i}]")
    else:
        assert type(ours) is type(ref), where
        assert ours == ref or (ours != ours and ref != ref), where


def assert_same_torch(back: object, ref: object, where: str = "top") -> None:
    """Two torch.load results are equal: types, order, dtypes, shapes, flags and bits."""
    torch = pytest.importorskip("torch")
    assert type(back) is type(ref), (where, type(back), type(ref))
    if isinstance(ref, torch.Tensor):
        assert (back.dtype, back.shape, back.requires_grad) == (ref.dtype, ref.shape, ref.requires_grad), (
            where
        )
        assert torch_bytes(back) == torch_bytes(ref), where
    elif isinstance(ref, dict):
        assert list(back) == list(ref), where
        for key in ref:
            assert_same_torch(back[key], ref[key], f"{where}[{key!r}]")
    elif isinstance(ref, list | tuple):
        for i, (a, b) in enumerate(zip(back, ref, strict=True)):
            assert_same_torch(a, b, f"{where}[{i}]")
    else:
        assert back == ref or (back != back and ref != ref), where


def assert_refused(path: Path, match: str, error: type[FormatError] = FormatError) -> FormatError:
    with pytest.raises(error) as caught:
        load_pt(path)
    message = str(caught.value)
    assert caught.value.path == os.fspath(path) and message.startswith(f"{path}: ")
    assert match in message and "\n" not in message and "Traceback" not in message
    return caught.value


# --------------------------------------------------------------------------------------------
# zip surgery for damaged inputs


def make_zip(
    path: Path, records: dict[str, bytes], prefix: str = "archive", method=zipfile.ZIP_STORED
) -> Path:
    with zipfile.ZipFile(path, "w", method) as archive:
        for name, data in records.items():
            archive.writestr(f"{prefix}/{name}", data)
    return path


def records_of(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {info.filename.split("/", 1)[1]: archive.read(info) for info in archive.infolist()}


# --------------------------------------------------------------------------------------------
# reading torch's own files


@pytest.mark.parametrize("path", READABLE, ids=fixture_id)
def test_fixture_matches_torch_load(path):
    torch = pytest.importorskip("torch")
    ours = load_pt(path)
    trusted_non_weights_only = path.name == "protocol4.pt"  # our own file; weights_only can't read protocol 4
    ref = torch.load(path, weights_only=not trusted_non_weights_only, map_location="cpu")
    assert_matches_torch(ours, ref)


@pytest.mark.parametrize("path", [p for p in ALL_FIXTURES if p.name in REFUSED], ids=fixture_id)
def test_fixture_is_refused_cleanly(path):
    assert_refused(path, REFUSED[path.name])


def test_known_values_without_torch():
    """Values as torch printed them for these fixtures (no torch needed here)."""
    torch_dir = FIXTURES / "torch"
    assert load_pt(torch_dir / "bfloat16.pt")["tensor"].numpy().astype(np.float32).tolist() == [
        1.5,
        -2.5,
        3.5,
    ]
    assert load_pt(torch_dir / "int64.pt")["tensor"].numpy().tolist() == [100, -200, 300, 0]
    assert load_pt(torch_dir / "bool.pt")["tensor"].numpy().tolist() == [True, False, True, True, False]
    scalar = load_pt(torch_dir / "scalar.pt")["tensor"]
    assert scalar.shape == () and scalar.numpy() == 42.0
    assert load_pt(torch_dir / "empty.pt")["tensor"].shape == (0,)
    special = load_pt(torch_dir / "special_values.pt")["tensor"].numpy()
    assert math.isnan(special[0]) and special[1:].tolist() == [math.inf, -math.inf, 0.0, 1.0]
    views = load_pt(torch_dir / "legacy_uncloned_views.pt")
    assert views["tensor1"].numpy().tolist() == list(range(10, 20))
    assert views["tensor2"].numpy().tolist() == list(range(50, 60))
    assert views["tensor1"].info["storage_key"] == views["tensor2"].info["storage_key"]
    checkpoint = load_pt(torch_dir / "checkpoint.pt")
    assert (checkpoint["epoch"], checkpoint["loss"]) == (42, 0.123)
    assert checkpoint["model_state_dict"]["fc1.weight"].shape == (10, 5)
    param = load_pt(torch_dir / "parameter.pt")["param"]
    assert param.info["parameter"] and param.info["requires_grad"] and param.shape == (3, 3)


@pytest.mark.parametrize("path", ALL_FIXTURES, ids=fixture_id)
def test_sniff(path):
    if path.name == "broken.pt":
        expected = None
    elif path.suffix == ".tar":
        expected = "tar"
    else:
        expected = "zip" if zipfile.is_zipfile(path) else "legacy"
        assert ("legacy" in path.name) == (expected == "legacy")
    assert sniff_pt(path) == expected
    assert is_pt(path) == (expected is not None)


def test_sniff_rejects_other_files(tmp_path):
    assert not is_pt(make_zip(tmp_path / "other.zip", {"readme.txt": b"hi"}))
    (tmp_path / "text.pt").write_text("hello")
    assert not is_pt(tmp_path / "text.pt")
    assert not is_pt(tmp_path / "missing.pt")
    assert not is_pt(tmp_path)
    assert not is_pt(FIXTURES / "burn" / "mnist-model.bpk")


def test_views_share_one_storage():
    for name in ("views.pt", "legacy_views.pt"):
        loaded = load_pt(FIXTURES / "torch_extra" / name)
        floats = {k: v for k, v in loaded.items() if k not in ("expanded", "int_view")}
        assert len({t.info["storage_key"] for t in floats.values()}) == 1, name
        assert loaded["transposed"].info["stride"] == (1, 6)
        assert loaded["offset_slice"].info["storage_offset"] == 5
        assert loaded["element"].shape == ()
        assert loaded["expanded"].info["stride"] == (1, 0)


def test_opening_reads_only_the_pickle(tmp_path):
    """Tensor bytes come from the memory map when asked for, not when the file is opened."""
    path = tmp_path / "lazy.pt"
    save_pt({"a": np.arange(4, dtype=np.float32), "b": np.arange(3, dtype=np.int64)}, path)
    loaded = load_pt(path)
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo("lazy/data/0")
    raw = path.read_bytes()
    name_length, extra_length = struct.unpack_from("<HH", raw, info.header_offset + 26)
    start = info.header_offset + 30 + name_length + extra_length
    with open(path, "r+b") as fh:  # same inode: the map sees the change
        fh.seek(start)
        fh.write(np.array([9, 8, 7, 6], dtype="<f4").tobytes())
    assert loaded["a"].numpy().tolist() == [9, 8, 7, 6]
    assert not loaded["a"].numpy().flags.writeable
    assert loaded["b"].numpy().tolist() == [0, 1, 2]


def test_any_archive_folder_name(tmp_path):
    torch = pytest.importorskip("torch")
    records = records_of(FIXTURES / "torch" / "state_dict.pt")
    path = make_zip(tmp_path / "renamed.pt", records, prefix="whatever")
    assert_matches_torch(load_pt(path), torch.load(path, weights_only=True))


def test_big_endian_records_are_byteswapped():
    torch = pytest.importorskip("torch")
    path = FIXTURES / "torch_extra" / "big_endian.pt"
    assert records_of(path)["byteorder"] == b"big"
    assert_matches_torch(load_pt(path), torch.load(FIXTURES / "torch_extra" / "views.pt", weights_only=True))


# --------------------------------------------------------------------------------------------
# writing files torch reads


def small_mlp(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


OPTIMIZERS = {
    "adam": lambda torch, params: torch.optim.Adam(params, lr=1e-2),
    "adamw-amsgrad": lambda torch, params: torch.optim.AdamW(params, amsgrad=True, weight_decay=0.1),
    "sgd-nesterov": lambda torch, params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
}


def trained(torch, make_optimizer, steps: int = 3):
    model = small_mlp(torch)
    optimizer = make_optimizer(torch, model.parameters())
    inputs = torch.randn(8, 4)
    for _ in range(steps):
        optimizer.zero_grad()
        model(inputs).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_state_dict_round_trip(tmp_path, name):
    torch = pytest.importorskip("torch")
    model, optimizer = trained(torch, OPTIMIZERS[name])
    original = optimizer.state_dict()
    torch.save(original, tmp_path / "torch.pt")
    save_pt(load_pt(tmp_path / "torch.pt"), tmp_path / "statekit.pt")
    reference = torch.load(tmp_path / "torch.pt", weights_only=True)
    for mmap in (False, True):
        back = torch.load(tmp_path / "statekit.pt", weights_only=True, mmap=mmap)
        assert_same_torch(back, reference)
        if "betas" in original["param_groups"][0]:
            assert type(back["param_groups"][0]["betas"]) is tuple
        fresh = OPTIMIZERS[name](torch, model.parameters())
        fresh.load_state_dict(back)
        assert_same_torch(fresh.state_dict(), original)
        model(torch.randn(2, 4)).sum().backward()
        fresh.step()


def test_checkpoint_round_trip(tmp_path):
    torch = pytest.importorskip("torch")
    model, optimizer = trained(torch, OPTIMIZERS["adam"])
    checkpoint = {"model": model.state_dict(), "optim": optimizer.state_dict(), "epoch": 3, "loss": 0.25}
    torch.save(checkpoint, tmp_path / "torch.pt")
    save_pt(load_pt(tmp_path / "torch.pt"), tmp_path / "statekit.pt")
    back = torch.load(tmp_path / "statekit.pt", weights_only=True, mmap=True)
    reference = torch.load(tmp_path / "torch.pt", weights_only=True)
    assert type(reference["model"]).__name__ == "OrderedDict" and type(back["model"]) is dict
    back["model"] = type(reference["model"])(back["model"])
    assert_same_torch(back, reference)
    model.load_state_dict(back["model"])


@pytest.mark.parametrize("path", READABLE, ids=fixture_id)
def test_fixture_round_trip(tmp_path, path):
    """load_pt → save_pt keeps every value torch sees (Parameters and requires_grad included)."""
    torch = pytest.importorskip("torch")
    trusted_non_weights_only = path.name == "protocol4.pt"
    reference = torch.load(path, weights_only=not trusted_non_weights_only)
    save_pt(load_pt(path), tmp_path / "copy.pt")
    for mmap in (False, True):
        back = torch.load(tmp_path / "copy.pt", weights_only=True, mmap=mmap)
        assert_matches_torch(load_pt(tmp_path / "copy.pt"), back)
        assert_same_torch(_plain(back), _plain(reference))


def _plain(obj: object) -> object:
    """torch.load's containers with OrderedDict → dict and Size → tuple, tensor attributes dropped."""
    torch = __import__("torch")
    if isinstance(obj, torch.Tensor):
        plain = obj.detach().clone()
        return (
            torch.nn.Parameter(plain, obj.requires_grad)
            if isinstance(obj, torch.nn.Parameter)
            else plain.requires_grad_(obj.requires_grad)
        )
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return (tuple if isinstance(obj, tuple) else list)(_plain(v) for v in obj)
    return obj


ALL_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "Bool"]


def sample_array(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    np_dtype = dtypes.numpy_dtype(dtype)
    count = math.prod(shape)
    raw = np.random.default_rng(seed).integers(0, 256, size=count * np_dtype.itemsize, dtype=np.uint8)
    if dtype == "Bool":
        raw %= 2
    return raw.view(np_dtype).reshape(shape)


@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 3), (2, 3, 4)], ids=str)
def test_numpy_arrays_load_in_torch(tmp_path, shape):
    torch = pytest.importorskip("torch")
    arrays = {name: sample_array(name, shape) for name in ALL_DTYPES}
    arrays["flex"] = TensorRef.from_array(sample_array("F32", shape), "Flex32")
    save_pt(arrays, tmp_path / "arrays.pt")
    for mmap in (False, True):
        back = torch.load(tmp_path / "arrays.pt", weights_only=True, mmap=mmap)
        for name, array in arrays.items():
            dtype = "Flex32" if name == "flex" else name
            assert str(back[name].dtype) == f"torch.{STATEKIT_TO_TORCH[dtype]}", name
            assert tuple(back[name].shape) == shape, name
            expected = bytes(array.raw()) if isinstance(array, TensorRef) else array.tobytes()
            assert torch_bytes(back[name]) == expected, name


@FAST
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    shape=st.lists(st.integers(0, 4), max_size=3).map(tuple),
    seed=st.integers(0, 2**32 - 1),
    parameter=st.booleans(),
)
def test_property_save_then_load(dtype, shape, seed, parameter):
    array = sample_array(dtype, shape, seed)
    tensor = TensorRef.from_array(array)
    tensor.info.update(parameter=parameter, requires_grad=parameter)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.pt"
        save_pt({"t": tensor, "meta": (dtype, shape)}, path)
        back = load_pt(path)
    assert back["meta"] == (dtype, shape)
    assert (back["t"].dtype, back["t"].shape, back["t"].info["parameter"]) == (dtype, shape, parameter)
    assert bytes(back["t"].raw()) == array.tobytes()


@settings(max_examples=15, deadline=None)
@given(dtype=st.sampled_from(ALL_DTYPES), shape=st.lists(st.integers(0, 3), max_size=3).map(tuple))
def test_property_torch_reads_what_we_save(dtype, shape):
    torch = pytest.importorskip("torch")
    array = sample_array(dtype, shape)
    with tempfile.TemporaryDirectory() as tmp:
        save_pt({"t": array}, Path(tmp) / "t.pt")
        back = torch.load(Path(tmp) / "t.pt", weights_only=True, mmap=True)["t"]
        assert torch_bytes(back) == array.tobytes() and tuple(back.shape) == shape


def test_layout_follows_torch(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    values = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "e": np.zeros(0, np.float16), "n": 1}
    save_pt(values, tmp_path / "ours.pt")
    torch.save(
        {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in values.items()},
        tmp_path / "theirs.pt",
    )
    ours, theirs = records_of(tmp_path / "ours.pt"), records_of(tmp_path / "theirs.pt")
    assert list(ours) == list(theirs)
    for name in (".format_version", ".storage_alignment", "byteorder", "version", "data/0", "data/1"):
        assert ours[name] == theirs[name], name
    assert len(ours[".data/serialization_id"]) == 40 and ours[".data/serialization_id"].isdigit()
    raw = (tmp_path / "ours.pt").read_bytes()
    with zipfile.ZipFile(tmp_path / "ours.pt") as archive:
        assert archive.testzip() is None
        for info in archive.infolist():
            assert info.filename.startswith("ours/") and info.compress_type == zipfile.ZIP_STORED
            name_length, extra_length = struct.unpack_from("<HH", raw, info.header_offset + 26)
            assert (info.header_offset + 30 + name_length + extra_length) % 64 == 0, info.filename
    # torch can also compute every storage offset itself from miniz's layout rules
    from torch.utils.serialization import config

    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    with config.patch({"load.calculate_storage_offsets": True}):  # torch's own patcher restores cleanly
        back = torch.load(tmp_path / "ours.pt", weights_only=True, mmap=True)
    assert back["w"].tolist() == values["w"].tolist()


def test_zip64_records(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch_pt, "_ZIP64_LIMIT", 100)
    monkeypatch.setattr(torch_pt, "_ZIP64_COUNT_LIMIT", 3)
    values = {"big": np.arange(60, dtype=np.float32), "small": np.arange(3, dtype=np.int64), "pair": (1, 2.5)}
    save_pt(values, tmp_path / "z64.pt")
    with zipfile.ZipFile(tmp_path / "z64.pt") as archive:
        assert archive.testzip() is None and len(archive.infolist()) == 8
    for mmap in (False, True):
        back = torch.load(tmp_path / "z64.pt", weights_only=True, mmap=mmap)
        assert back["big"].tolist() == values["big"].tolist() and back["pair"] == (1, 2.5)
    assert load_pt(tmp_path / "z64.pt")["small"].numpy().tolist() == [0, 1, 2]


def test_archive_folder_is_the_file_stem(tmp_path):
    for name, folder in (("model.best.pt", "model.best"), ("noext", "noext"), (".pt", "archive")):
        save_pt({"x": 1}, tmp_path / name)
        assert list(records_of(tmp_path / name))[0] == "data.pkl"
        with zipfile.ZipFile(tmp_path / name) as archive:
            assert archive.namelist()[0] == f"{folder}/data.pkl"


def test_save_over_the_file_being_read(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "state.pt"
    shutil.copy(FIXTURES / "torch" / "checkpoint.pt", path)
    save_pt(load_pt(path), path)  # the tensors still read the old file through its map
    assert_same_torch(
        _plain(torch.load(path, weights_only=True)),
        _plain(torch.load(FIXTURES / "torch" / "checkpoint.pt", weights_only=True)),
    )


def test_failed_save_leaves_the_target_alone(tmp_path):
    target = tmp_path / "keep.pt"
    target.write_bytes(b"old")
    with pytest.raises(MappingError, match="cannot write a object"):
        save_pt({"fine": np.ones(2), "bad": object()}, target)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["keep.pt"]


# --------------------------------------------------------------------------------------------
# malicious and damaged files


def malicious_payloads(marker: Path) -> dict[str, bytes]:
    return {
        "os.system": pickle.dumps({"state": SystemCall(f"touch {marker}")}, protocol=2),
        "builtins.exec": pickle.dumps({"state": ExecCall(f"open({str(marker)!r}, 'w').close()")}, protocol=2),
    }


@pytest.mark.parametrize("kind", ["os.system", "builtins.exec"])
def test_malicious_zip_pt_is_refused(tmp_path, kind):
    marker = tmp_path / "pwned"
    payload = malicious_payloads(marker)[kind]
    path = make_zip(tmp_path / "evil.pt", {"data.pkl": payload, "byteorder": b"little", "version": b"3\n"})
    named = f"{os.system.__module__}.system" if kind == "os.system" else kind
    error = assert_refused(path, f"refusing to load global '{named}' from pickle", UnsafePickleError)
    assert isinstance(error, FormatError)
    assert not marker.exists()
    torch = pytest.importorskip("torch")
    with pytest.raises(pickle.UnpicklingError):  # torch's weights_only loader refuses it too
        torch.load(path, weights_only=True)
    assert not marker.exists()


def test_malicious_legacy_pt_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    head = b"".join(
        pickle.dumps(v, protocol=2) for v in (torch_pt.LEGACY_MAGIC_NUMBER, 1001, {"little_endian": True})
    )
    path = tmp_path / "evil_legacy.pt"
    path.write_bytes(head + malicious_payloads(marker)["builtins.exec"])
    assert sniff_pt(path) == "legacy"
    assert_refused(path, "refusing to load global 'builtins.exec'", UnsafePickleError)
    assert not marker.exists()


@pytest.mark.parametrize(
    "keep", [slice(0, 4), slice(0, 100), slice(0, 1000), slice(0, -22), slice(0, -1)], ids=str
)
def test_truncated_zip(tmp_path, keep):
    path = tmp_path / "cut.pt"
    path.write_bytes((FIXTURES / "torch" / "checkpoint.pt").read_bytes()[keep])
    assert_refused(path, "damaged zip archive")


def test_zip_with_bytes_missing_in_the_middle(tmp_path):
    data = (FIXTURES / "torch" / "checkpoint.pt").read_bytes()
    path = tmp_path / "gap.pt"
    path.write_bytes(data[:200] + data[900:])
    assert_refused(path, "zip")


def test_empty_file_missing_file_and_directory(tmp_path):
    (tmp_path / "empty.pt").write_bytes(b"")
    assert_refused(tmp_path / "empty.pt", "not a PyTorch file")
    assert_refused(tmp_path / "missing.pt", "cannot read file")
    assert_refused(tmp_path, "cannot read file")


def damaged(tmp_path: Path, changes: dict[str, bytes | None]) -> Path:
    """checkpoint.pt with some records replaced (or dropped when None)."""
    records = records_of(FIXTURES / "torch" / "checkpoint.pt")
    for name, data in changes.items():
        if data is None:
            del records[name]
        else:
            records[name] = data
    return make_zip(tmp_path / "damaged.pt", records)


def test_missing_data_pkl(tmp_path):
    assert_refused(damaged(tmp_path, {"data.pkl": None}), "no <folder>/data.pkl entry")


def test_missing_storage(tmp_path):
    assert_refused(damaged(tmp_path, {"data/2": None}), "refers to storage '2', but data/2 is missing")


def test_storage_shorter_than_claimed(tmp_path):
    short = records_of(FIXTURES / "torch" / "checkpoint.pt")["data/0"][:-4]
    assert_refused(
        damaged(tmp_path, {"data/0": short}),
        "should hold 50 float32 elements (200 bytes), but data/0 holds 196",
    )


def test_storage_shorter_than_the_view_needs(tmp_path):
    path = make_zip(
        tmp_path / "view.pt", {"data.pkl": wrap(tensor_call(numel=4, size=(8,))), "data/0": bytes(16)}
    )
    assert_refused(path, "needs 8 elements of storage '0', which holds 4")


def test_huge_claimed_size_is_checked_before_anything_is_allocated(tmp_path):
    claim = TensorRef("F32", (10**15,), loader=lambda: pytest.fail("the claimed data must not be read"))
    pickled, _ = torch_pickle.dumps({"t": claim})
    path = make_zip(tmp_path / "huge.pt", {"data.pkl": pickled, "data/0": bytes(16)})
    assert_refused(path, "should hold 1000000000000000 float32 elements (4000000000000000 bytes)")


def test_pickle_that_hits_the_end(tmp_path):
    pickled = records_of(FIXTURES / "torch" / "checkpoint.pt")["data.pkl"]
    assert_refused(damaged(tmp_path, {"data.pkl": pickled[:-30]}), "pickle is truncated")


def test_compressed_entries_are_refused(tmp_path):
    path = make_zip(
        tmp_path / "deflated.pt", records_of(FIXTURES / "torch" / "scalar.pt"), method=zipfile.ZIP_DEFLATED
    )
    assert_refused(path, "is compressed")


def test_bad_byteorder_record(tmp_path):
    assert_refused(damaged(tmp_path, {"byteorder": b"middle"}), "unknown byteorder")


def legacy_bytes() -> bytes:
    return (FIXTURES / "torch" / "legacy_uncloned_views.pt").read_bytes()


def test_truncated_legacy(tmp_path):
    data = legacy_bytes()
    for cut, match in (
        (20, "pickle is truncated"),
        (300, "pickle is truncated"),
        (len(data) - 8, "is truncated"),
    ):
        path = tmp_path / f"cut{cut}.pt"
        path.write_bytes(data[:cut])
        assert_refused(path, match)


def test_legacy_storage_count_mismatch(tmp_path):
    data = bytearray(legacy_bytes())
    count_at = len(data) - 100 * 4 - 8  # one storage of 100 float32 elements at the end
    assert struct.unpack_from("<q", data, count_at)[0] == 100
    struct.pack_into("<q", data, count_at, 2**40)
    path = tmp_path / "count.pt"
    path.write_bytes(bytes(data))
    assert_refused(path, "holds 1099511627776 elements, the pickle says 100")


def test_legacy_extra_storage_key(tmp_path):
    data = legacy_bytes()
    keys_at = data.index(pickle.dumps(["94081730766256"], protocol=2))
    tail = data[keys_at + len(pickle.dumps(["94081730766256"], protocol=2)) :]
    path = tmp_path / "keys.pt"
    path.write_bytes(data[:keys_at] + pickle.dumps(["94081730766256", "1"], protocol=2) + tail)
    assert_refused(path, "does not match the storages the pickle uses")


@pytest.mark.torch
def test_tensors_outside_any_state_dict_are_refused_not_shown_as_none(tmp_path, cli):
    """A file whose tensors sit where no optimizer or model state_dict is (Megatron's distrib_optim.pt
    read on its own: buffers keyed by dtype tuples) was shown as '0 tensors'; it is refused, naming
    where the first tensor is. A dict of plain scalars still inspects as holding none."""
    torch = pytest.importorskip("torch")
    odd = tmp_path / "distrib_optim.pt"
    torch.save({"buckets_coalesced": True, 0: {(torch.bfloat16, torch.float32): {
        "param": torch.ones(8), "exp_avg": torch.zeros(8), "numel_unpadded": 8}}}, odd)
    r = cli("inspect", odd)
    assert r.returncode == 1, r.stdout
    assert "holds 2 tensors but neither an optimizer state_dict nor a model state_dict" in r.stderr
    assert "'param'" in r.stderr and "Traceback" not in r.stderr
    plain = tmp_path / "plain.pt"
    torch.save({"epoch": 3, "note": "x"}, plain)
    r = cli("inspect", plain, "--json")
    assert r.returncode == 0, r.stderr
