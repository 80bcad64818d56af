"""What to tell a user whose layer dy2static could not convert into a static program.

Paddle's dy2static error ("In transformed code: ...") lists the frames of the
converted code, Paddle's own among them, with the failing line marked ``<--- HERE``
and the original error last. The user needs three things out of it: where in their
code, what Python construct was refused, and the way out (dynamic mode).
"""

from __future__ import annotations

import re

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')

# A refused construct, by what Paddle's error says of it.
_CONSTRUCTS = (
    ("bool(Tensor) is not supported",
     "Python control flow on a tensor's value (`if`, `while`, `and`/`or` on a Tensor)"),
    ("_is_initialized", "reading a tensor's value as a Python number (`.item()`)"),
    ("numpy()", "reading a tensor's value into NumPy (`.numpy()`)"),
    ("RecursionError", "a call that recurses once converted (a `super()` in an inherited method, say)"),
)


def explain(mode: str, error: BaseException) -> str | None:
    """The message for a failed conversion of ``mode``'s program; None if ``error`` is not dy2static's.

    A refused construct it recognises (`_CONSTRUCTS`) gets dynamic mode as the way out; any other
    error at the user's line (a batch of a dtype the layer cannot take, say) gets it as a maybe."""
    text = f"{type(error).__name__}: {error}"
    if "In transformed code" not in text:
        return None
    where, marked = _user_frame(text)
    construct = next((what for marker, what in _CONSTRUCTS if marker in text), None)
    message = f"the {mode} program cannot be built for these inputs"
    if where:
        message += f": dy2static stopped at {where}" + (f": `{marked}`" if marked else "")
    said = _original_error(text)
    if said:
        message += f"; Paddle says: {said}"
    if construct:
        return (f"{message}; dy2static refuses {construct}. To run the layer as written, build the model "
                "with to_static(..., dynamic=True): the ranks run it eagerly with the same placements, no "
                "conversion; or rewrite that line as Paddle's message suggests")
    return (f"{message}. If that line is Python dy2static cannot convert, to_static(..., dynamic=True) runs the "
            "layer eagerly, as written")


def _user_frame(text: str) -> tuple[str | None, str | None]:
    """'file:line (in func)' of the deepest frame outside Paddle, and its line marked HERE."""
    found, marked = None, None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m is None or "/paddle/" in m["file"].replace("\\", "/"):
            continue
        found, marked = f"{m['file']}:{m['line']} (in {m['func']})", None
        for later in lines[i + 1 :]:
            if _FRAME.match(later):
                break
            if "<--- HERE" in later and marked is None:
                marked = _previous_code(lines, lines.index(later, i + 1))
    return found, marked


def _previous_code(lines: list[str], here: int) -> str | None:
    """The code line the ``~~~ <--- HERE`` line at ``here`` underlines."""
    for line in reversed(lines[:here]):
        if line.strip():
            return line.strip()
    return None


def _original_error(text: str) -> str | None:
    """The original error, which closes Paddle's listing of frames (at most 1000 characters)."""
    tail = text.rsplit("<--- HERE", 1)[-1].splitlines()
    for i, line in enumerate(tail):
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line.strip()):
            said = " ".join(part.strip() for part in tail[i:] if part.strip())
            return said if len(said) <= 1000 else said[:1000] + " ..."
    return None
