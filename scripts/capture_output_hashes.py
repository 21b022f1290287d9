#!/usr/bin/env python3
"""Record the sha256 of every output statekit writes from the committed fixtures.

These are regression anchors: the outputs were validated against real torch/burn by the tests
that build and load them; the hashes pin them so that a change of the data path (streaming,
``--jobs``) cannot change a single byte. Run from the repository root on the commit whose outputs
are the reference; it rewrites ``tests/data/output-sha256.json``. ``tests/test_output_hashes.py``
replays the same cases and compares.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGETS = {"bpk": ("out.bpk", None), "pt": ("out.pt", None), "safetensors": ("out.safetensors", None),
           "candle": ("out.safetensors", "candle")}
VARIANTS = {
    "plain": {},
    "adam": {"optimizer": "adam"},
    "transpose": {"transpose": ["*.weight"]},
    "adam-transpose": {"optimizer": "adam", "transpose": ["*.weight"]},
    "f16": {"dtype": "f16"},
    "adamw-f64-transpose": {"optimizer": "adamw", "dtype": "f64", "transpose": ["*.weight"]},
    "nonfinite": {"allow_nonfinite": True},
}
MIG = "fixtures/migration"


def sources() -> list[str]:
    out = []
    for pattern in ("fixtures/*.bpk", "fixtures/legacy/*", "fixtures/legacy-bpk/*.bpk", f"{MIG}/optim-*.bpk",
                    "fixtures/torch/*.pt", "fixtures/candle/*.safetensors", "fixtures/burn/*.bpk"):
        out += sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern))
    return [s for s in out if not s.endswith(".npz")]


def cases() -> list[dict]:
    out = []
    for src in sources():
        for target in TARGETS:
            for variant in VARIANTS:
                out.append({"op": "convert", "src": src, "target": target, "variant": variant})
    for src in sources():
        if src.endswith(".bpk"):
            for target in ("bpk", "safetensors", "pt"):
                for variant in ("plain", "adam", "f16"):
                    out.append({"op": "convert", "src": src, "target": target, "variant": variant, "via_pt": True,
                                "optimizer": "adam" if variant == "adam" else None})
    model_v2 = f"{MIG}/model-grown.bpk"
    for model, extra in ((f"{MIG}/model-renamed.bpk", {"rename": [r"^l1\.=encoder.0.", r"^l2\.=head."]}),
                         (f"{MIG}/model-new-head.bpk", {}),
                         (model_v2, {"resize": True}),
                         (model_v2, {"resize": True, "reset_step": ["l1.weight"]})):
        for target in ("bpk", "pt", "safetensors"):
            out.append({"op": "remap", "src": "fixtures/hand-optim.bpk", "model": model, "target": target,
                        "options": extra})
    for inputs, conflict in (([f"{MIG}/optim-l1.bpk", f"{MIG}/optim-l2.bpk"], "error"),
                             (["fixtures/hand-optim.bpk", f"{MIG}/optim-run2.bpk"], "first"),
                             (["fixtures/hand-optim.bpk", f"{MIG}/optim-run2.bpk"], "last"),
                             (["fixtures/hand-optim.bpk", f"{MIG}/optim-run2.bpk"], "mean"),
                             (["fixtures/hand-optim.bpk", "fixtures/hand-optim.bpk", f"{MIG}/optim-run2.bpk"], "mean")):
        out.append({"op": "merge", "inputs": inputs, "on_conflict": conflict})
    return out


def source_names(src: str) -> list[str]:
    """The source state's parameter paths in order (empty when some parameter has none)."""
    import statekit.api as api
    from statekit.errors import StatekitError

    try:
        with api.open(src) as ckpt:
            paths = [p.path for p in ckpt.optimizer.params] if ckpt.optimizer is not None else []
    except StatekitError:
        return []
    return paths if paths and all(paths) and len(set(paths)) == len(paths) else []


def run_case(case: dict, folder: str) -> str | None:
    """The output's sha256, or None when statekit refuses the case (a StatekitError)."""
    import warnings

    import statekit.api as api
    from statekit.errors import StatekitError

    case = {k: (str(ROOT / v) if k in ("src", "model") else v) for k, v in case.items()}
    if case["op"] == "merge":
        case["inputs"] = [str(ROOT / i) for i in case["inputs"]]
        dst = os.path.join(folder, "out.bpk")
        call = lambda: api.merge(case["inputs"], dst, on_conflict=case["on_conflict"])  # noqa: E731
    else:
        name, to = TARGETS[case["target"]]
        dst = os.path.join(folder, name)
        extra = {}
        if case["target"] == "pt":  # torch pairs state by position: name it from the source's paths
            extra["names"] = source_names(case["src"]) or None
            if "transpose" not in {**VARIANTS.get(case.get("variant"), {}), **case.get("options", {})}:
                extra["no_transpose"] = ["*"]
        if case["op"] == "convert":
            call = lambda: api.convert(case["src"], dst, to=to, **VARIANTS[case["variant"]], **extra)  # noqa: E731
        else:
            call = lambda: api.remap(case["src"], dst, model=case["model"], to=to, **case["options"],  # noqa: E731
                                     **{k: v for k, v in extra.items() if k != "names"})
    # The reference predates the statekit.moves record (where each parameter's state came from,
    # for verify-resume; tests/test_verify_pairing.py): outputs are hashed without it.
    from unittest import mock

    try:
        with warnings.catch_warnings(), mock.patch("statekit.ops.convert.moves_metadata", lambda plan: {}):
            warnings.simplefilter("ignore")
            if case.get("via_pt"):  # the source converted to .pt first: torch input, positions named
                names = source_names(case["src"])
                if not names:
                    return None
                mid = os.path.join(folder, "mid.pt")
                api.convert(case["src"], mid, names=names, no_transpose=["*"], optimizer=case.get("optimizer"))
                case = {**case, "src": mid}
                call = lambda: api.convert(mid, dst, to=to, names=names, no_transpose=["*"],  # noqa: E731
                                           **VARIANTS[case["variant"]])
            call()
    except StatekitError:
        return None
    except (ValueError, TypeError, KeyError):  # a refusal that is not (yet) a StatekitError
        return None
    with open(dst, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    os.remove(dst)
    return digest


def case_id(case: dict) -> str:
    if case.get("via_pt"):
        return f"convert {case['src']} -> pt -> {case['target']} [{case['variant']}]"
    if case["op"] == "convert":
        return f"convert {case['src']} -> {case['target']} [{case['variant']}]"
    if case["op"] == "remap":
        return f"remap {case['src']} onto {case['model']} -> {case['target']} {json.dumps(case['options'])}"
    return f"merge {' + '.join(case['inputs'])} [{case['on_conflict']}]"


def main() -> None:
    table = {}
    with tempfile.TemporaryDirectory() as folder:
        for case in cases():
            digest = run_case(case, folder)
            if digest is not None:
                table[case_id(case)] = {"case": case, "sha256": digest}
    path = ROOT / "tests/data/output-sha256.json"
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{len(table)} outputs recorded in {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
