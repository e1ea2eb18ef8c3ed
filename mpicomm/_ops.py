"""Reduction operators and what each dtype allows."""
import enum

from .errors import invalid


class ReduceOp(str, enum.Enum):
    """Reduction operators, equal to MindSpore's strings (``ReduceOp.SUM == "sum"``)."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    def __str__(self):
        return self.value


_BY_NAME = {}
for _op in ReduceOp:
    _BY_NAME[_op] = _op
    _BY_NAME[_op.value] = _op
    _BY_NAME[_op.name] = _op
    _BY_NAME[_op.value.upper()] = _op
_BY_NAME["mean"] = ReduceOp.AVG

ALLOWED_OPS = "one of ReduceOp.SUM, PROD, MIN, MAX, AVG (or 'sum', 'prod', 'min', 'max', 'avg')"


def as_op(op):
    """Normalise ``op`` to a :class:`ReduceOp`; raise InvalidArgumentError if unknown."""
    try:
        return _BY_NAME[op]
    except (KeyError, TypeError):
        raise invalid("op", op, ALLOWED_OPS) from None


# kind codes of numpy dtypes: 'f' float, 'c' complex, 'i' signed, 'u' unsigned, 'V' bfloat16 (ml_dtypes)
def check_op_dtype(op, dtype, floating, complex_):
    """Raise if ``op`` is not defined for ``dtype``.

    AVG needs a floating or complex dtype (an integer mean would truncate silently);
    MIN and MAX have no meaning for complex numbers, and PROD of complex numbers is
    not element-wise over (real, imag) so the NCCL backend could not do it: complex
    dtypes allow SUM and AVG only, on both backends.
    """
    if op is ReduceOp.AVG and not (floating or complex_):
        raise invalid("op", op.value, f"SUM, PROD, MIN or MAX for integer dtype {dtype}; "
                      "AVG needs a floating dtype (cast first, or reduce with SUM and divide)")
    if complex_ and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise invalid("op", op.value, f"SUM or AVG for complex dtype {dtype}")
