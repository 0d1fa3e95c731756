"""Routed teachers for `kdcache onpolicy`: `--teacher math=DIR --teacher code=DIR2 --route-field domain`. Each prompt's
field names the teacher that scores its completion; a round writes one cache per teacher it used, and the student
trains on all of them at once (`kdcache train --cache A --cache B`: drawn in proportion to the positions left)."""
import json

from kdcache.common.errors import ConfigError, DataError

BASE = "base"    # a teacher named `base`: the LoRA student's own base weights


def teachers(teacher) -> dict:
    """{name: teacher} of --teacher: one unnamed teacher ({"": DIR}), or NAME=DIR entries (several, or one)."""
    entries = [teacher] if isinstance(teacher, str) else [str(t) for t in teacher]
    if len(entries) == 1 and "=" not in entries[0]:
        return {"": entries[0]}
    out = {}
    for e in entries:
        name, sep, path = e.partition("=")
        if not sep or not name.strip() or not path.strip() or "/" in name:
            raise ConfigError(f"teacher: {e!r}: with routed teachers each --teacher is NAME=DIR (or NAME=URL, "
                              "NAME=base), e.g. --teacher math=runs/math-teacher")
        if name in out:
            raise ConfigError(f"teacher: {name!r} is named twice")
        out[name] = path
    return out


def routes(rows, places, field, names) -> list:
    """The teacher name of each prompt row (a JSON text), from its `field`; a row whose field names no teacher is
    a bad record, refused before any work, named by its place ("FILE:LINE")."""
    out = []
    for row, where in zip(rows, places):
        try:
            rec = json.loads(row)
        except ValueError:
            raise DataError(f"{where}: not a JSON record, so its field {field!r} cannot route it") from None
        value = rec.get(field) if isinstance(rec, dict) else None
        if not isinstance(value, str) or value not in names:
            raise DataError(f"{where}: field {field!r} is {value!r}, which names no teacher (--teacher "
                            f"{', '.join(f'{n}=...' for n in names)}); fix the record or name a teacher for it")
        out.append(value)
    return out
