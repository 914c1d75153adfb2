"""A small FileCheck for MLIR text in tests (LLVM's FileCheck is not in the wheel).

Directives, one per line, matched in order against the text's lines:

    CHECK: <pattern>          the next line (at or after the cursor) containing the pattern
    CHECK-LABEL: <pattern>    same, and marks a section start (CHECK-NOT looks no further back)
    CHECK-NEXT: <pattern>     the line right after the previous match
    CHECK-NOT: <pattern>      no line between the previous match and the next one contains it
    CHECK-COUNT-<n>: <pattern>  n lines in order that contain it (like CHECK repeated n times)

A pattern is literal text with `{{regex}}` pieces, as in FileCheck. Failures
raise AssertionError with the directive and the text around the cursor.
"""

from __future__ import annotations

import re

_DIRECTIVE = re.compile(r"^\s*(?://|#)?\s*(CHECK(?:-LABEL|-NEXT|-NOT|-COUNT-(\d+))?):\s?(.*)$")


def pattern_regex(pattern: str) -> re.Pattern:
    """FileCheck pattern -> compiled regex: literal text, `{{...}}` pieces are regular expressions."""
    parts = re.split(r"\{\{(.*?)\}\}", pattern.strip())
    return re.compile("".join(re.escape(p) if i % 2 == 0 else f"(?:{p})" for i, p in enumerate(parts)))


def _directives(checks: str):
    out = []
    for raw in checks.splitlines():
        if not raw.strip():
            continue
        m = _DIRECTIVE.match(raw)
        if not m:
            raise ValueError(f"not a CHECK directive: {raw!r}")
        kind, count, pattern = m.groups()
        if not pattern.strip():
            raise ValueError(f"empty pattern in {raw!r}")
        if count is not None:
            out.extend([("CHECK", pattern)] * int(count))
        else:
            out.append((kind, pattern))
    return out


def filecheck(text: str, checks: str) -> None:
    """Assert that `text` satisfies the CHECK directives in `checks`."""
    lines = text.splitlines()
    cursor = 0  # first line a positive directive may match
    last = -1  # line of the previous positive match
    pending_not: list[tuple[str, re.Pattern]] = []

    def fail(msg):
        lo = max(0, cursor - 3)
        context = "\n".join(f"{i:5d}: {line[:200]}" for i, line in enumerate(lines[lo:cursor + 5], lo))
        raise AssertionError(f"{msg}\n--- text around line {cursor}:\n{context}")

    def close_nots(until):
        for raw, rx in pending_not:
            for i in range(last + 1, until):
                if rx.search(lines[i]):
                    fail(f"CHECK-NOT: {raw} matched line {i}: {lines[i][:200]}")
        pending_not.clear()

    for kind, raw in _directives(checks):
        rx = pattern_regex(raw)
        if kind == "CHECK-NOT":
            pending_not.append((raw, rx))
            continue
        if kind == "CHECK-NEXT":
            if last < 0 or last + 1 >= len(lines) or not rx.search(lines[last + 1]):
                fail(f"CHECK-NEXT: {raw} does not match the line after line {last}")
            found = last + 1
        else:
            found = next((i for i in range(cursor, len(lines)) if rx.search(lines[i])), None)
            if found is None:
                fail(f"{kind}: {raw} not found")
        close_nots(found)
        last, cursor = found, found + 1
    close_nots(len(lines))


def count_matches(text: str, pattern: str) -> int:
    """Number of lines of `text` that contain the FileCheck `pattern`."""
    rx = pattern_regex(pattern)
    return sum(1 for line in text.splitlines() if rx.search(line))
