"""torch.distributed.checkpoint (DCP): read without torch, write what real torch loads.

Fixtures in fixtures/dcp/ are written by real torch 2.13 (scripts/make_dcp_fixtures.py: FSDP2 on
CPU with gloo, AdamW with two groups, dcp.save at world size 1 and 2, and torch's own
dcp_to_torch_save of each); every expectation below is torch's reading of the same bytes.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import socket
import sys

import numpy as np
import pytest

from statekit import io
from statekit.errors import FormatError, UnsafePickleError
from statekit.formats import dcp, torch_pickle
from tests.conftest import FIXTURES, ROOT

DCP = FIXTURES / "dcp"
torch = pytest.importorskip("torch")


def _script():
    spec = importlib.util.spec_from_file_location("make_dcp_fixtures", ROOT / "scripts" / "make_dcp_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_dcp_fixtures"] = module
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _equal(ours, ref, where="") -> None:
    """statekit's value (TensorRef/plain) equals torch's (tensor/plain): values, dtypes, key order."""
    if isinstance(ref, torch.Tensor):
        assert tuple(ours.shape) == tuple(ref.shape), where
        assert ours.numpy().dtype == ref.numpy().dtype, where
        assert np.array_equal(ours.numpy(), ref.numpy()), where
    elif isinstance(ref, dict):
        assert list(ours) == list(ref), where
        for k in ref:
            _equal(ours[k], ref[k], f"{where}.{k}")
    elif isinstance(ref, list | tuple):
        assert type(ours) is type(ref) and len(ours) == len(ref), where
        for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
            _equal(a, b, f"{where}[{i}]")
    else:
        assert ours == ref and type(ours) is type(ref), where


def _torch_equal(a, b, where="", close=False) -> None:
    """Same structure and values: bit for bit, or with ``close`` to float32 rounding (a few ULPs
    after 10 steps)."""
    if isinstance(b, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7) if close else torch.equal(a, b), where
    elif isinstance(b, dict):
        assert list(a) == list(b), where
        for k in b:
            _torch_equal(a[k], b[k], f"{where}.{k}", close)
    elif isinstance(b, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _torch_equal(x, y, f"{where}[{i}]", close)
    else:
        assert a == b, where


@pytest.mark.parametrize("world", [1, 2])
def test_reader_rebuilds_the_state_dict_torch_rebuilds(world):
    reader = dcp.DcpReader(DCP / f"ws{world}")
    assert len(reader.meta.files) == world
    _equal(reader.state_dict(), torch.load(DCP / f"ws{world}.pt", weights_only=True))


def test_sharded_tensors_are_assembled_from_both_ranks_files():
    meta = dcp.read_metadata(DCP / "ws2")
    entry = meta.entries["optim.state.head.weight.exp_avg"]
    assert entry.shape == (3, 8) and len(entry.chunks) == 2
    assert {c.file for c in entry.chunks} == {"__0_0.distcp", "__1_0.distcp"}
    ref = torch.load(DCP / "ws2.pt", weights_only=True)["optim"]["state"]["head.weight"]["exp_avg"]
    assert np.array_equal(dcp.DcpReader(DCP / "ws2").tensor(entry).numpy(), ref.numpy())


@pytest.mark.parametrize("path", ["ws1", "ws2", "accelerate/optimizer_0", "ws2.pt", "ws2/__1_0.distcp"])
def test_inspect_names_every_parameter(path):
    ref = torch.load(DCP / "ws2.pt", weights_only=True)["optim"]
    with io.open_checkpoint(DCP / path) as ckpt:
        opt = ckpt.optimizer
        assert ckpt.kind == "optimizer" and opt.family == "adamw"
        names = [n for g in ref["param_groups"] for n in g["params"]]
        assert [p.path for p in opt.params] == names
        assert [len(g.keys) for g in opt.groups] == [len(g["params"]) for g in ref["param_groups"]]
        assert [g.hyperparams["weight_decay"] for g in opt.groups] == [0.1, 0.0]
        for p in opt.params:
            assert p.step == ref["state"][p.path]["step"].item() == 3
            assert np.array_equal(p.slots["exp_avg_sq"].numpy(), ref["state"][p.path]["exp_avg_sq"].numpy())


def test_cli_inspect_of_a_dcp_directory(cli):
    r = cli("inspect", DCP / "ws2", "--json")
    assert r.returncode == 0, r.stderr
    assert "embed.weight" in r.stdout and "adamw" in r.stdout


@pytest.mark.parametrize("world", [1, 2])
def test_convert_to_pt_equals_dcp_to_torch_save(tmp_path, cli, world):
    out = tmp_path / "out.pt"
    r = cli("convert", DCP / f"ws{world}", out)
    assert r.returncode == 0, r.stderr
    _torch_equal(torch.load(out, weights_only=True), torch.load(DCP / f"ws{world}.pt", weights_only=True))


def test_pt_to_dcp_with_shards_reads_back_in_torch(tmp_path, cli):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    r = cli("convert", DCP / "ws2.pt", tmp_path / "ckpt", "--shards", "3")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "again.pt")
    _torch_equal(torch.load(tmp_path / "again.pt", weights_only=True),
                 torch.load(DCP / "ws2.pt", weights_only=True))


def test_metadata_written_by_statekit_pickles_only_dcp_names(tmp_path):
    dcp.save(tmp_path, {"opt": {"state": {"w": {"step": 1.0}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}})
    data = (tmp_path / ".metadata").read_bytes()
    found = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            found.add(f"{module}.{name}")
            return super().find_class(module, name)

    import io as pyio

    Recorder(pyio.BytesIO(data)).load()
    assert found <= set(dcp.DCP_GLOBALS) | {"torch.Size", "torch.float32"}


def test_metadata_refuses_a_global_outside_the_allow_list(tmp_path):
    shutil.copytree(DCP / "ws1", tmp_path / "ck")
    meta = tmp_path / "ck" / ".metadata"
    data = meta.read_bytes()
    meta.write_bytes(data.replace(b"pathlib", b"os\x00\x00\x00\x00\x00").replace(b"\x07PosixPath", b"\x07system\x00\x00\x00"))
    with pytest.raises(UnsafePickleError):
        dcp.read_metadata(tmp_path / "ck")
    # and torch.save pickles never accept the DCP classes
    with pytest.raises(UnsafePickleError):
        torch_pickle.loads((DCP / "ws1" / ".metadata").read_bytes())


def test_truncated_data_file_is_one_clear_error(tmp_path, cli):
    shutil.copytree(DCP / "ws2", tmp_path / "ck")
    data = tmp_path / "ck" / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    r = cli("inspect", tmp_path / "ck")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "truncated" in r.stderr and "__1_0.distcp" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_chunk_is_refused(tmp_path):
    shutil.copytree(DCP / "ws2", tmp_path / "ck")
    (tmp_path / "ck" / "__0_0.distcp").unlink()
    with pytest.raises(FormatError, match="__0_0.distcp is missing"):
        dcp.read_metadata(tmp_path / "ck")


def test_flat_optimizer_form_is_read_with_groups_from_hyperparameters(tmp_path):
    """torchtitan's flatten_optimizer_state_dict=True form, written by torch itself."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    mod = _script()
    model, opt, _ = mod.build(1)  # no process group: plain modules
    mod.train(model, opt, mod.batches(2))
    flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    save({"optimizer": flat}, checkpoint_id=tmp_path / "flat", no_dist=True)
    with io.open_checkpoint(tmp_path / "flat") as ckpt:
        groups = [[ckpt.optimizer.params[int(k)].path for k in g.keys] for g in ckpt.optimizer.groups]
        assert groups == [[n for n in g["params"]] for g in get_optimizer_state_dict(model, opt)["param_groups"]]
        assert any("inferred" in n for n in ckpt.optimizer.notes)


@pytest.mark.slow
def test_dcp_written_by_statekit_resumes_bit_identically(tmp_path, cli):
    """Two statekit-written DCPs, each loaded by torch (dcp.load + set_*_state_dict) at world size 2
    with FSDP2; 10 more steps equal, bit for bit, torch resuming from its own DCP (``ws2``) on this
    machine:

    - torch's dcp_to_torch_save output → statekit DCP in 3 files (the whole state_dict);
    - DCP → burnpack → DCP in 2 files (the optimizer alone, keyed by name, through plans) with the
      model weights from torch's .pt.

    torch's own resume is in turn compared with the run that never stopped, recorded when the
    fixtures were made: to float32 rounding only, since matmul kernels (and so the last bits) differ
    between CPUs (an AVX-512 FP16 machine against the one that wrote the fixture).
    """
    r = cli("convert", DCP / "ws2.pt", tmp_path / "whole", "--shards", "3")
    assert r.returncode == 0, r.stderr
    r = cli("convert", DCP / "ws2", tmp_path / "o.bpk", "--transpose", "*.weight")
    assert r.returncode == 0, r.stderr
    r = cli("convert", tmp_path / "o.bpk", tmp_path / "optim", "--transpose", "*.weight", "--shards", "2")
    assert r.returncode == 0, r.stderr
    mod = _script()
    import torch.multiprocessing as mp

    # the spawned processes import the worker's module by name, with the parent's sys.path
    if str(ROOT / "scripts") not in sys.path:
        sys.path.append(str(ROOT / "scripts"))
    runs = [(str(DCP / "ws2"), None, str(tmp_path / "after-torch.pt")),
            (str(tmp_path / "whole"), None, str(tmp_path / "after-whole.pt")),
            (str(tmp_path / "optim"), str(DCP / "ws2.pt"), str(tmp_path / "after-optim.pt"))]
    mp.spawn(mod.resume_worker, args=(2, _free_port(), runs), nprocs=2, join=True)
    by_torch = torch.load(runs[0][2], weights_only=True)
    for _, _, out in runs[1:]:
        _torch_equal(torch.load(out, weights_only=True), by_torch, out)
    recorded = torch.load(DCP / "resume.pt", weights_only=True)["after"]
    _torch_equal(by_torch, recorded, "torch's resume", close=True)
