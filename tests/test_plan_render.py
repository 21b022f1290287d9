"""A long plan shows its first and last rows and every drop or new parameter; a dry run, TSV and
JSON show every row; drawn without rich the text is rich's."""

from __future__ import annotations

from statekit.ops.plan import ParamAction, Plan
from statekit.render import boxes
from statekit.render.plan import HEAD_ROWS, PLAN_ROWS, TAIL_ROWS, plan_tsv, plan_view, shown_rows


def plan_of(actions: list[str]) -> Plan:
    params = [ParamAction(a, src_key=str(i), src_path=f"p{i}", dst_path=None if a == "drop" else f"q{i}",
                          dst_index=i, dst_shape=[4, 2]) for i, a in enumerate(actions)]
    return Plan("remap", "a.bpk", "burnpack", "b.bpk", "burnpack", "adam", params=params)


def text_of(items) -> str:
    return "".join(item.plain(200) if isinstance(item, boxes.Line) else boxes.draw(item, 200) for item in items)


def test_a_short_plan_shows_every_row():
    plan = plan_of(["keep"] * PLAN_ROWS)
    assert shown_rows(plan.params, full=False) == list(range(PLAN_ROWS))
    assert "not shown" not in text_of(plan_view(plan))


def test_a_long_plan_shows_its_ends_and_every_drop_and_new():
    actions = ["rename"] * 200
    actions[50], actions[51], actions[120] = "drop", "new", "drop"
    plan = plan_of(actions)
    rows = shown_rows(plan.params, full=False)
    shown = [i for i in rows if isinstance(i, int)]
    assert shown == [*range(HEAD_ROWS), 50, 51, 120, *range(200 - TAIL_ROWS, 200)]
    gaps = [g for g in rows if isinstance(g, tuple)]
    assert gaps == [(HEAD_ROWS, 50 - HEAD_ROWS), (52, 120 - 52), (121, 200 - TAIL_ROWS - 121)]
    assert len(shown) + sum(n for _, n in gaps) == 200
    text = text_of(plan_view(plan))
    assert "│ p50 " in text and "│ p51 " in text and "│ p120 " in text and "│ p199 " in text
    assert "│ p16 " not in text and f"{200 - len(shown)} of 200 rows not shown" in text
    full = text_of(plan_view(plan, full=True))
    assert all(f"│ p{i} " in full for i in range(200)) and "not shown" not in full
    assert len(plan_tsv(plan)[1]) == 200  # --format tsv: every row


def test_the_cli_dry_run_shows_every_row_and_the_run_a_summary(tmp_path, cli):
    import numpy as np

    from statekit.formats.burnpack import PackTensor, Scalar, write_burnpack
    from statekit.tensor import TensorRef

    tensors, strings, scalars = [], {}, {}
    for i in range(60):
        pid = 1000 + i
        for field in ("momentum.moment_1", "momentum.moment_2"):
            tensors.append(PackTensor(f"{pid}.{field}", TensorRef.from_array(np.full(3, 0.5, np.float32)), param_id=pid))
        scalars[f"{pid}.__rank"] = Scalar("UInt", 1)
        scalars[f"{pid}.momentum.time"] = Scalar("UInt", 7)
        strings[str(pid)] = f"layer{i}.bias"
    write_burnpack(tmp_path / "a.bpk", tensors, strings, scalars)
    dry = cli("convert", tmp_path / "a.bpk", tmp_path / "b.safetensors", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert all(f"layer{i}.bias " in dry.stdout for i in range(60)) and "not shown" not in dry.stdout
    run = cli("convert", tmp_path / "a.bpk", tmp_path / "b.safetensors")
    assert run.returncode == 0, run.stderr
    assert "layer0.bias " in run.stdout and "layer59.bias " in run.stdout and "layer30.bias " not in run.stdout
    assert "40 of 60 rows not shown" in run.stdout and (tmp_path / "b.safetensors").exists()
