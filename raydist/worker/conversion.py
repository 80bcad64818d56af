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
    ("bool(Tensor) is not supported", "Python control flow on a tensor's value (`if`, `while`, `and`/`or` on a Tensor)"),
    ("_is_initialized", "reading a tensor's value as a Python number (`.item()`)"),
    ("numpy()", "reading a tensor's value into NumPy (`.numpy()`)"),
    ("RecursionError", "a call that recurses once converted (a `super()` in an inherited method, say)"),
)


def explain(mode: str, error: BaseException) -> str | None:
    """The message for a failed conversion of ``mode``'s program; None if ``error`` is not dy2static's."""
    text = f"{type(error).__name__}: {error}"
    if "In transformed code" not in text:
        return None
    where, marked = _user_frame(text)
    last = _original_error(text)
    construct = next((what for marker, what in _CONSTRUCTS if marker in text), None)
    parts = [f"dy2static cannot convert the layer into the {mode} program"]
    if where:
        parts[0] += f" at {where}" + (f": `{marked}`" if marked else "")
    if construct:
        parts.append(f"it refuses {construct}")
    if last:
        parts.append(f"Paddle says: {last}")
    parts.append("to run the layer as written, build the model with to_static(..., dynamic=True): the ranks run it "
                 "eagerly with the same placements, no conversion; or rewrite that line as Paddle's message suggests")
    return "; ".join(parts)


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
    """The first line of the original error, which closes Paddle's listing of frames."""
    tail = text.rsplit("<--- HERE", 1)[-1]
    for line in tail.splitlines():
        stripped = line.strip()
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", stripped):
            return stripped
    return None
