"""Pure helpers: Kubernetes ``$(VAR)`` expansion and mount-path rewriting."""

from __future__ import annotations

from collections.abc import Mapping


def expand(text: str, env: Mapping[str, str]) -> str:
    """Expand ``$(VAR)`` as Kubernetes does for command, args and env values.

    ``$(NAME)`` becomes NAME's value when NAME is defined and stays as written otherwise;
    ``$$`` is an escaped ``$`` (so ``$$(NAME)`` yields the literal ``$(NAME)``); an
    unterminated ``$(`` and a ``$`` before any other character are kept as they are.
    """
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch != "$" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            end = text.find(")", i + 2)
            if end < 0:
                out.append(text[i:])
                break
            name = text[i + 2 : end]
            out.append(env.get(name, f"$({name})"))
            i = end + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


def rewrite_path(value: str, mounts: Mapping[str, str]) -> str:
    """Map an in-container path to the local directory that realizes its volume mount.

    ``mounts`` maps a mountPath to a local directory. A value equal to a mountPath or under
    it (``/models/x``) is rewritten, the longest mountPath winning; so is the part after the
    first ``=`` of a ``--flag=/models/x`` style value. Anything else is returned unchanged.
    """
    rewritten = _rewrite_one(value, mounts)
    if rewritten != value:
        return rewritten
    head, sep, tail = value.partition("=")
    if sep and tail:
        new_tail = _rewrite_one(tail, mounts)
        if new_tail != tail:
            return f"{head}={new_tail}"
    return value


def _rewrite_one(value: str, mounts: Mapping[str, str]) -> str:
    best = ""
    for mount in mounts:
        m = mount.rstrip("/") or "/"
        if (value == m or value.startswith(m.rstrip("/") + "/")) and len(m) > len(best):
            best = m
    if not best:
        return value
    local = mounts[best] if best in mounts else mounts[best + "/"]
    rest = value[len(best) :]
    return local.rstrip("/") + rest if rest else local
