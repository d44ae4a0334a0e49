"""A task's Dockerfile as Apptainer builds it, for hosts with Apptainer and no Docker.

`translate(text)` and `definition(text, context)` (the same as a definition file) are pure
functions; `sandbox/sif.py` builds the translation. The build context is copied whole into the
image at CONTEXT_IN (`%files`), and every instruction becomes, in order, a line of `%post`:
`RUN` its shell line, `COPY`/`ADD` a copy out of the context with Docker's semantics (a
directory's contents, several sources into a directory), `WORKDIR` a `mkdir -p` and `cd`, `ENV`
and `ARG` (with its default) an `export`; then the context is removed. `ENV` also goes to
`%environment`, `LABEL` to `%labels`. `CMD`, `ENTRYPOINT`, `EXPOSE`, `VOLUME`, `HEALTHCHECK`,
`STOPSIGNAL`, `SHELL`, `USER` and `MAINTAINER` change nothing a sandbox uses and are skipped.
What it cannot express is refused with the line: several stages, `COPY --from`, `ADD` of a URL
or an archive, `ONBUILD`. `FROM` becomes `Bootstrap: docker` (Apptainer pulls it), or
`docker-daemon` where asked.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import PurePosixPath

CONTEXT_IN = "/.polar-mitm-context"
SKIPPED = frozenset(
    {"CMD", "ENTRYPOINT", "EXPOSE", "VOLUME", "HEALTHCHECK", "STOPSIGNAL", "SHELL", "USER", "MAINTAINER"}
)
ARCHIVES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".zip")
# COPY with Docker's rules: a directory's contents; several sources, or a destination ending in
# "/" or an existing directory, go into the destination directory.
COPY_FN = (
    "_polar_copy() { d=$1; shift; many=$#; for s; do"
    ' if [ -d "$s" ]; then mkdir -p "$d"; cp -a "$s"/. "$d"/;'
    ' elif [ "$many" -gt 1 ] || [ -d "$d" ] || [ "${d%/}" != "$d" ]; then mkdir -p "$d"; cp -a "$s" "$d"/;'
    ' else mkdir -p "$(dirname "$d")"; cp -a "$s" "$d"; fi; done; }'
)


class DockerfileError(ValueError):
    """A Dockerfile this translation cannot express (the message names the line)."""


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction) with continuations joined and comments dropped."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf.append(line[:-1])
            continue
        buf.append(line)
        out.append((start, " ".join(p.strip() for p in buf)))
        buf = []
    if buf:
        out.append((start, " ".join(p.strip() for p in buf)))
    return out


def _args(rest: str) -> list[str]:
    """An instruction's arguments: exec form (a JSON list) or words."""
    rest = rest.strip()
    if rest.startswith("["):
        try:
            value = json.loads(rest)
        except ValueError:
            value = None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    return shlex.split(rest)


def _pairs(rest: str) -> list[tuple[str, str]]:
    """`ENV`/`LABEL`/`ARG` pairs: `K=V K2="V 2"`, or the legacy `ENV K V W`."""
    words = shlex.split(rest)
    if words and "=" not in words[0]:
        return [(words[0], " ".join(words[1:]))]
    return [tuple(w.split("=", 1)) if "=" in w else (w, "") for w in words]  # type: ignore[misc]


@dataclass
class Definition:
    bootstrap: str
    image: str
    post: list[str] = field(default_factory=list)
    environment: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)

    def script(self) -> str:
        """`%post` as one shell script (the context at CONTEXT_IN)."""
        return "\n".join(["set -e", COPY_FN, *self.post, ""])

    def text(self, context: str) -> str:
        lines = [
            f"Bootstrap: {self.bootstrap}",
            f"From: {self.image}",
            "",
            "%files",
            f"    {context} {CONTEXT_IN}",
            "",
        ]
        lines += [
            "%post",
            "    set -e",
            f"    {COPY_FN}",
            *(f"    {p}" for p in self.post),
            f"    rm -rf {CONTEXT_IN}",
            "",
        ]
        if self.environment:
            lines += ["%environment", *(f"    {e}" for e in self.environment), ""]
        if self.labels:
            lines += ["%labels", *(f"    {lab}" for lab in self.labels), ""]
        return "\n".join(lines)


def definition(text: str, context: str, *, bootstrap: str = "docker") -> str:
    """The Apptainer definition that builds what `text` (a Dockerfile) builds from `context`."""
    return translate(text, bootstrap=bootstrap).text(context)


def translate(text: str, *, bootstrap: str = "docker") -> Definition:
    """`text` (a Dockerfile) as its base image and the lines of its `%post`, `%environment`
    and `%labels` (the context expected at CONTEXT_IN)."""
    d: Definition | None = None
    workdir = "/"
    for n, line in logical_lines(text):
        word, _, rest = line.partition(" ")
        op = word.upper()
        where = f"Dockerfile line {n}: {line[:120]}"
        if op == "FROM":
            if d is not None:
                raise DockerfileError(f"{where}: several stages cannot be built without Docker")
            args = [a for a in rest.split() if not a.startswith("--")]
            if not args:
                raise DockerfileError(f"{where}: FROM names no image")
            d = Definition(bootstrap, args[0])
            continue
        if d is None:
            if op == "ARG":
                continue  # an ARG before FROM only parameterises FROM
            raise DockerfileError(f"{where}: an instruction before FROM")
        if op == "RUN":
            args = _args(rest)
            cmd = rest.strip() if not rest.strip().startswith("[") else shlex.join(args)
            d.post.append(f"( {cmd} )")
        elif op in ("COPY", "ADD"):
            words = _args(rest)
            flags = [w for w in words if w.startswith("--")]
            paths = [w for w in words if not w.startswith("--")]
            if any(f.startswith("--from") for f in flags):
                raise DockerfileError(f"{where}: COPY --from (another stage) cannot be built without Docker")
            if len(paths) < 2:
                raise DockerfileError(f"{where}: {op} needs a source and a destination")
            *srcs, dest = paths
            if op == "ADD" and any("://" in s or s.endswith(ARCHIVES) for s in srcs):
                raise DockerfileError(f"{where}: ADD of a URL or an archive is not translated; use RUN")
            for s in srcs:
                if PurePosixPath(s).is_absolute() or ".." in PurePosixPath(s).parts:
                    raise DockerfileError(f"{where}: a source outside the build context")
            target = (
                dest
                if dest.startswith("/")
                else str(PurePosixPath(workdir) / dest) + ("/" if dest.endswith("/") else "")
            )
            quoted = " ".join(
                f"{CONTEXT_IN}/{s}" if any(c in s for c in "*?[") else shlex.quote(f"{CONTEXT_IN}/{s}")
                for s in srcs
            )
            d.post.append(f"_polar_copy {shlex.quote(target)} {quoted}")
        elif op == "WORKDIR":
            path = rest.strip()
            workdir = path if path.startswith("/") else str(PurePosixPath(workdir) / path)
            d.post.append(f"mkdir -p {shlex.quote(workdir)} && cd {shlex.quote(workdir)}")
        elif op in ("ENV", "ARG"):
            for k, v in _pairs(rest):
                if op == "ARG" and not v:
                    continue
                d.post.append(f"export {k}={shlex.quote(v)}")
                if op == "ENV":
                    d.environment.append(f"export {k}={shlex.quote(v)}")
        elif op == "LABEL":
            d.labels += [f"{k} {v}" for k, v in _pairs(rest)]
        elif op == "ONBUILD":
            raise DockerfileError(f"{where}: ONBUILD is not translated")
        elif op in SKIPPED:
            continue
        else:
            raise DockerfileError(f"{where}: unknown instruction {word}")
    if d is None:
        raise DockerfileError("the Dockerfile has no FROM")
    return d
