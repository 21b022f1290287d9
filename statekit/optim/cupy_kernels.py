"""CuPy kernels for burn's Adam/AdamW and candle's AdamW: one element-wise CUDA kernel per step.

The reference (:mod:`statekit.optim.adam`) runs on CuPy arrays as a chain of CuPy operations,
one kernel launch and one pass over memory each. Here the whole step is one
``cupy.ElementwiseKernel``: every input read once, every output written once.

Exactness. Each operation of the flavor is written as the CUDA intrinsic that performs exactly
that IEEE-754 operation with round-to-nearest: ``__fadd_rn``, ``__fsub_rn``, ``__fmul_rn``,
``__fdiv_rn``, ``__fsqrt_rn``. nvcc/NVRTC never contract these into an FMA (the intrinsics
exist for that purpose), and the kernel is also compiled with ``--fmad=false``, ``--ftz=false``
(subnormals kept, as on the CPU), ``--prec-div=true`` and ``--prec-sqrt=true``. The operations
and their operand order are the reference's (burn: one rounding per tensor op; candle: its
``affine(x, mul, add) = x*mul + add`` with the ``+ 0.0`` kept literally). One difference is
known and not modelled: a NaN produced by GPU arithmetic is the canonical NaN, where x86
propagates an input NaN's payload; a NaN stays a NaN, its bits may differ.

No GPU was available when this was written. The kernel *source* is checked on the CPU: the
step bodies below use only the intrinsics above, declarations and assignments, a subset that
:func:`emulate` runs with numpy (each intrinsic is the numpy float32 operation with the same
rounding), and the tests compare that emulation bit for bit with the reference. Whether CuPy
compiles and launches it as written is untested on real hardware.
"""

from __future__ import annotations

import ast
import re
from functools import cache

import numpy as np

from statekit.errors import UsageError
from statekit.optim.burn_scalars import burn_scalars
from statekit.optim.fp import f32, powi

#: (algorithm, flavor) pairs with a CuPy kernel
SUPPORTS = {("adam", "burn"), ("adamw", "burn"), ("adamw", "candle")}  # = kernels.CUPY_SUPPORTS

#: NVRTC options: no contraction, subnormals kept, IEEE division and square root
OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")

#: numpy's ``maximum(a, b)``: the first NaN operand, else ``a`` if ``a > b``, else ``b`` (so
#: ``maximum(-0.0, +0.0)`` is ``+0.0`` and ``maximum(+0.0, -0.0)`` is ``-0.0``, as numpy gives)
PREAMBLE = """
__device__ __forceinline__ float np_maximum(float a, float b) {
    return (a != a) ? a : ((b != b) ? b : ((a > b) ? a : b));
}
"""


def burn_body(hp, step: int, present) -> tuple[str, dict[str, float]]:
    """The CUDA body and its float32 scalars for burn's Adam/AdamW (see :mod:`statekit.optim.adam`)."""
    first, amsgrad, decoupled = step == 0, hp["amsgrad"], hp["decoupled_weight_decay"]
    everything, decay = burn_scalars(hp, step)
    scalars = {name: everything[name] for name in ("beta1", "beta2", "c1", "c2", "lr")}
    lines = []
    grad = "g"
    if not decoupled and everything["wd"] != 0:
        scalars["wd"] = everything["wd"]
        lines.append("float gd = __fadd_rn(__fmul_rn(p, wd), g);")
        grad = "gd"
    lines.append(f"float gg = __fmul_rn({grad}, {grad});")
    if first:
        lines.append(f"m = __fmul_rn({grad}, c1);")
        lines.append("v = __fmul_rn(gg, c2);")
    else:
        lines.append(f"m = __fadd_rn(__fmul_rn(m, beta1), __fmul_rn({grad}, c1));")
        lines.append("v = __fadd_rn(__fmul_rn(v, beta2), __fmul_rn(gg, c2));")
    vv = "v"
    if amsgrad:
        if first or "max_exp_avg_sq" not in present:
            lines.append("vmax = v;")
        else:
            lines.append("vmax = np_maximum(vmax, v);")
        vv = "vmax"
    if decoupled:
        scalars |= {name: everything[name] for name in ("bc1", "bc2", "eps")}
        lines.append(f"float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn({vv}, bc2)), eps);")
        lines.append("float u = __fdiv_rn(m, bc1);")
    else:
        scalars |= {name: everything[name] for name in ("cf", "eps_b2")}
        lines.append(f"float denom = __fadd_rn(__fsqrt_rn({vv}), eps_b2);")
        lines.append("float u = __fmul_rn(m, cf);")
    lines.append("u = __fmul_rn(__fdiv_rn(u, denom), lr);")
    if decoupled and decay != 0:
        scalars["decay"] = everything["decay"]
        lines.append("p = __fsub_rn(__fmul_rn(p, decay), u);")
    else:
        lines.append("p = __fsub_rn(p, u);")
    return "\n".join(lines), {name: f32(float(value)) for name, value in scalars.items()}


def candle_body(hp, step: int, present) -> tuple[str, dict[str, float]]:
    """The CUDA body and its float32 scalars for candle's AdamW, each ``affine`` literally."""
    t = step + 1
    beta1, beta2, lr = hp["beta1"], hp["beta2"], hp["lr"]
    scalars = {
        "beta1": beta1, "c1": 1.0 - beta1, "beta2": beta2, "c2": 1.0 - beta2,
        "scale_m": 1.0 / (1.0 - powi(beta1, t, np.float64)),
        "scale_v": 1.0 / (1.0 - powi(beta2, t, np.float64)),
        "decay": 1.0 - lr * hp["weight_decay"], "eps": hp["eps"], "lr": lr, "one": 1.0, "zero": 0.0,
    }
    body = """
m = __fadd_rn(__fadd_rn(__fmul_rn(m, beta1), zero), __fadd_rn(__fmul_rn(g, c1), zero));
v = __fadd_rn(__fadd_rn(__fmul_rn(v, beta2), zero), __fadd_rn(__fmul_rn(__fmul_rn(g, g), c2), zero));
float update = __fadd_rn(__fmul_rn(m, scale_m), zero);
float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(__fadd_rn(__fmul_rn(v, scale_v), zero)), one), eps);
update = __fdiv_rn(update, denom);
p = __fsub_rn(__fadd_rn(__fmul_rn(p, decay), zero), __fadd_rn(__fmul_rn(update, lr), zero));
""".strip()
    return body, {name: f32(value) for name, value in scalars.items()}


def body(algorithm: str, flavor: str, hp, step: int, present) -> tuple[str, dict[str, float], tuple[str, ...]]:
    """``(cuda_body, scalars, outputs)`` of one step: ``outputs`` are ``p`` and the slots'
    short names (``m``, ``v``, ``vmax``), read and written in place."""
    if (algorithm, flavor) not in SUPPORTS:
        raise UsageError(f"there is no CuPy {flavor} {algorithm} kernel")
    text, scalars = (burn_body if flavor == "burn" else candle_body)(hp, step, present)
    outputs = ("p", "m", "v", "vmax") if hp["amsgrad"] else ("p", "m", "v")
    return text, scalars, outputs


SLOT_OF = {"m": "exp_avg", "v": "exp_avg_sq", "vmax": "max_exp_avg_sq"}


@cache
def _kernel(cupy, text: str, scalar_names: tuple[str, ...], outputs: tuple[str, ...]):
    in_params = ", ".join(["float32 g", *(f"float32 {name}" for name in scalar_names)])
    out_params = ", ".join(f"float32 {name}" for name in outputs)
    return cupy.ElementwiseKernel(in_params, out_params, text, "statekit_step", preamble=PREAMBLE,
                                  no_return=True, options=OPTIONS)


def run(algorithm: str, flavor: str, b, p, g, s: dict, step: int, hp, present) -> None:
    """One step in place on CuPy arrays ``p`` and the slots ``s`` (``step`` steps already taken)."""
    text, scalars, outputs = body(algorithm, flavor, hp, step, present)
    names = tuple(sorted(scalars))
    kernel = _kernel(b.xp, text, names, outputs)
    arrays = {"p": p, **{short: s[SLOT_OF[short]] for short in outputs[1:]}}
    kernel(g, *(np.float32(scalars[name]) for name in names), *(arrays[name] for name in outputs))


# ---------------------------------------------------------------------------------- emulation

#: each intrinsic the bodies may use, as the numpy float32 operation with the same rounding
INTRINSICS = {
    "__fadd_rn": np.add,
    "__fsub_rn": np.subtract,
    "__fmul_rn": np.multiply,
    "__fdiv_rn": np.divide,
    "__fsqrt_rn": np.sqrt,
    "np_maximum": np.maximum,
}
_STATEMENT = re.compile(r"^(?:(float)\s+)?([A-Za-z_]\w*)\s*=\s*(.+)$", re.S)


def emulate(text: str, variables: dict) -> dict:
    """Run a kernel body on the CPU: ``variables`` maps names to float32 numpy arrays or
    scalars; returns them with the body's assignments applied (arrays assigned in place).

    Only the subset the bodies use is accepted: ``float NAME = EXPR;`` and ``NAME = EXPR;``
    where ``EXPR`` is a name or a call of an :data:`INTRINSICS` function; anything else (a
    literal, an operator, an unknown function) is refused, so the emulation cannot silently
    differ from what the source says.
    """
    env = dict(variables)
    with np.errstate(all="ignore"):
        for statement in filter(None, (part.strip() for part in text.split(";"))):
            match = _STATEMENT.match(statement)
            if not match:
                raise ValueError(f"not in the emulated subset: {statement!r}")
            declared, name, expr = match.groups()
            value = _evaluate(ast.parse(expr.strip(), mode="eval").body, env)
            if declared:
                if name in env:
                    raise ValueError(f"{name} declared twice")
                env[name] = np.array(value, dtype=np.float32)
            elif name not in env:
                raise ValueError(f"{name} assigned before it is declared")
            elif isinstance(env[name], np.ndarray):
                env[name][...] = value
            else:
                env[name] = np.float32(value)
    return env


def _evaluate(node, env):
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise ValueError(f"unknown name {node.id}")
        return env[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in INTRINSICS:
        func = INTRINSICS[node.func.id]
        if node.keywords or len(node.args) != func.nin:
            raise ValueError(f"{node.func.id} takes {func.nin} arguments")
        out = func(*(_evaluate(arg, env) for arg in node.args))
        if np.asarray(out).dtype != np.float32:
            raise ValueError(f"{node.func.id} left float32")
        return out
    raise ValueError(f"not in the emulated subset: {ast.dump(node)}")
