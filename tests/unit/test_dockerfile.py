"""A Dockerfile as an Apptainer definition (sandbox/dockerfile.py): a pure translation, checked
line by line here and built for real in tests/processes/test_apptainer_real.py."""

from __future__ import annotations

import pytest

from polar_mitm.sandbox.dockerfile import CONTEXT_IN, DockerfileError, definition, logical_lines

DOCKERFILE = """\
# a task image
ARG BASE=ignored
FROM python:3.12-slim AS base
LABEL org.example.task="calc"
ENV LANG=C.UTF-8 GREETING="hello world"
WORKDIR /app
COPY requirements.txt .
RUN pip install -r requirements.txt \\
    && echo done
COPY src/ ./src/
ADD ["a b.txt", "/opt/"]
RUN ["python3", "-c", "print(1)"]
ARG MODE=fast
WORKDIR sub
CMD ["python3"]
USER 1000
"""


def test_each_instruction_in_order():
    text = definition(DOCKERFILE, "/ctx")
    head, _, rest = text.partition("%post")
    assert head.splitlines()[:2] == ["Bootstrap: docker", "From: python:3.12-slim"]
    assert f"    /ctx {CONTEXT_IN}" in head
    post = [line.strip() for line in rest.split("\n\n")[0].splitlines()][3:]
    assert post == [
        "export LANG=C.UTF-8",
        "export GREETING='hello world'",
        "mkdir -p /app && cd /app",
        f"_polar_copy /app {CONTEXT_IN}/requirements.txt",
        "( pip install -r requirements.txt && echo done )",
        f"_polar_copy /app/src/ {CONTEXT_IN}/src/",
        f"_polar_copy /opt/ '{CONTEXT_IN}/a b.txt'",
        "( python3 -c 'print(1)' )",
        "export MODE=fast",
        "mkdir -p /app/sub && cd /app/sub",
        f"rm -rf {CONTEXT_IN}",
    ]
    assert "%environment\n    export LANG=C.UTF-8\n    export GREETING='hello world'" in text
    assert "%labels\n    org.example.task calc" in text


def test_docker_daemon_bootstrap():
    assert definition("FROM img:1\nRUN true\n", "/c", bootstrap="docker-daemon").startswith(
        "Bootstrap: docker-daemon\nFrom: img:1\n"
    )


@pytest.mark.parametrize(
    "text,match",
    [
        ("FROM a AS b\nFROM c\n", "several stages"),
        ("FROM a\nCOPY --from=b /x /y\n", "COPY --from"),
        ("FROM a\nADD https://x/y.tgz /y\n", "URL or an archive"),
        ("FROM a\nCOPY ../secret /y\n", "outside the build context"),
        ("FROM a\nONBUILD RUN x\n", "ONBUILD"),
        ("FROM a\nFROBNICATE x\n", "unknown instruction"),
        ("RUN x\n", "before FROM"),
        ("# nothing\n", "no FROM"),
    ],
)
def test_what_it_cannot_express_is_refused_with_its_line(text, match):
    with pytest.raises(DockerfileError, match=match):
        definition(text, "/c")


def test_logical_lines_join_continuations_and_drop_comments():
    assert logical_lines("FROM a\n# c\nRUN x \\\n  # inner\n  && y\n\n") == [(1, "FROM a"), (3, "RUN x && y")]
