"""torch's dtypes as a pickle names them: statekit's name for each, the legacy storage classes,
and every dtype name a pickle may hold."""

from __future__ import annotations

from dataclasses import dataclass

from statekit.errors import FormatError

# torch dtype name -> statekit dtype name, for the dtypes statekit can hold.
TORCH_TO_STATEKIT = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "Bool",
}
STATEKIT_TO_TORCH = {v: k for k, v in TORCH_TO_STATEKIT.items()} | {"Flex32": "float32"}

# Legacy storage classes (the persistent-id type torch writes) -> torch dtype name.
_STORAGE_CLASSES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8",
    "QInt32Storage": "qint32",
    "QUInt8Storage": "quint8",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
}
_STORAGE_CLASS_FOR = {v: k for k, v in _STORAGE_CLASSES.items()}

# Every other torch dtype a pickle may name (as a value, or as _rebuild_tensor_v3's dtype).
_OTHER_TORCH_DTYPES = (
    "complex32 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu "
    "float4_e2m1fn_x2 bits1x8 bits2x4 bits4x2 bits8 bits16 "
    + " ".join(f"uint{i} int{i}" for i in range(1, 8))
).split()
TORCH_DTYPE_NAMES = (
    frozenset(TORCH_TO_STATEKIT) | frozenset(_STORAGE_CLASSES.values()) | frozenset(_OTHER_TORCH_DTYPES)
)


@dataclass(frozen=True)
class TorchDtype:
    """A ``torch.dtype`` value found in a pickle (``torch.float32`` → ``TorchDtype("float32")``)."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"


def statekit_dtype(torch_dtype: str) -> str:
    """statekit's dtype name for a torch dtype name; FormatError naming it when unsupported."""
    try:
        return TORCH_TO_STATEKIT[torch_dtype]
    except KeyError:
        pass
    if torch_dtype.startswith("complex"):
        kind = "complex tensors are"
    elif torch_dtype.startswith(("qint", "quint")):
        kind = "quantized tensors are"
    else:
        kind = "this dtype is"
    raise FormatError(f"tensor dtype torch.{torch_dtype} is not supported: {kind} not handled by statekit")
