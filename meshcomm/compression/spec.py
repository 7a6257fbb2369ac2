"""`compression=` arguments: `coerce` turns None, a name or a codec into a codec, AUTO or None."""
from __future__ import annotations

import dataclasses
import re
from typing import Union

from .cast import CAST_NAMES, Cast
from .zfp import ZFP

__all__ = ["Auto", "AUTO", "coerce", "CodecLike"]


@dataclasses.dataclass(frozen=True)
class Auto:
    """`compression="auto"`: the collective picks a codec per message (or none)."""

    def __str__(self) -> str:
        return "auto"


AUTO = Auto()
CodecLike = Union[None, str, ZFP, Cast, Auto]
_ZFP_STR = re.compile(r"zfp\((rate|tolerance|precision)=([^)]+)\)")
_VALID = ("None, 'bf16', 'fp16', 'auto', 'zfp(rate=8)' (or tolerance=, precision=), "
          "ZFP(...) or Cast(...)")


def coerce(x: CodecLike) -> ZFP | Cast | Auto | None:
    """A `compression=` argument as a codec (ZFP or Cast), AUTO, or None. Strings: "bf16",
    "fp16" (and "bfloat16", "float16"), "auto", and a codec's own str ("zfp(rate=8)")."""
    if x is None or isinstance(x, (ZFP, Cast, Auto)):
        return x
    if isinstance(x, str):
        s = x.strip().lower()
        if s == "auto":
            return AUTO
        if s in CAST_NAMES:
            return Cast(s)
        m = _ZFP_STR.fullmatch(s.replace(" ", ""))
        if m:
            mode, v = m.groups()
            try:
                num = int(v) if mode == "precision" else float(v)
            except ValueError:
                raise ValueError(f"compression {x!r}: {mode} {v!r} is not a number") from None
            return ZFP(**{mode: num})
        raise ValueError(f"unknown compression {x!r}: expected {_VALID}")
    raise TypeError(f"compression must be {_VALID}; got {type(x).__name__}")
