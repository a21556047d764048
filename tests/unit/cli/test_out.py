"""`qm list`'s columns (cli.out): aligned to the widest cell, cut to a terminal's width but never
when the output goes to a pipe, wide characters counted as two cells, colour only on a terminal
and never under NO_COLOR."""

from __future__ import annotations

import io
import re

import pytest

from cli import out


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


HEADERS = ("job id", "name", "state")
ROWS = [
    ("j-1", "a-very-long-name-that-does-not-fit-anywhere", "queued"),
    ("j-22", "short", "running"),
]
STYLES = [["", "", "cyan"], ["", "", "yellow"]]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def printed(stream: io.StringIO, title: str | None = None) -> list[str]:
    out.columns(HEADERS, ROWS, keep=("job id", "state"), styles=STYLES, stream=stream, title=title)
    return stream.getvalue().splitlines()


def test_a_pipe_gets_every_cell_whole_aligned_and_without_colour(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "20")  # a pipe ignores the terminal's width
    lines = printed(io.StringIO(), title="2 job(s)")
    assert lines == [
        "2 job(s)",
        "JOB ID  NAME                                         STATE",
        "j-1     a-very-long-name-that-does-not-fit-anywhere  queued",
        "j-22    short                                        running",
    ]


def test_a_terminal_cuts_the_widest_column_that_may_be_cut_and_colours_states(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "30")
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("TERM", raising=False)
    lines = printed(Terminal())
    plain = [ANSI.sub("", line) for line in lines]
    # 30 columns less two gaps: 26 cells; the id (6) and the state (7) are kept whole.
    assert plain == [
        "JOB ID  NAME           STATE",
        "j-1     a-very-long-…  queued",
        "j-22    short          running",
    ]
    assert "\x1b[36mqueued\x1b[0m" in lines[1] and "\x1b[33mrunning\x1b[0m" in lines[2]
    assert lines[0].startswith("\x1b[1m")  # a bold header


@pytest.mark.parametrize("env", [{"NO_COLOR": "1"}, {"TERM": "dumb"}])
def test_no_colour_when_asked(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("COLUMNS", "200")
    assert not any(ANSI.search(line) for line in printed(Terminal()))


def test_wide_characters_take_two_cells() -> None:
    assert out.width_of("ジョブ") == 6
    assert out.width_of("e\u0301") == 1  # a combining accent takes none
    assert out.cut("ジョブの名前", 7) == "ジョブ…"
    assert out.width_of(out.cut("ジョブの名前", 7)) <= 7
    assert out.cut("short", 7) == "short"


def test_columns_that_must_not_be_cut_are_kept_even_if_the_line_then_wraps() -> None:
    assert out.fit([10, 40, 7], [True, False, True], 30) == [10, 13, 7]
    assert out.fit([10, 40, 7], [True, False, True], 10) == [10, 5, 7]  # 5 cells at least
    assert out.fit([3, 4], [False, False], 100) == [3, 4]


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, "-"), ("", "-"), ([], "-"), (8.0, "8"), (0.5, "0.5"), (["a", "b"], "a, b")],
)
def test_cells(value: object, text: str) -> None:
    assert out.cell(value) == text


@pytest.mark.parametrize(
    ("hostile", "shown"),
    [
        ("\x1b[2J\x1b]0;pwned\x07name", "?[2J?]0;pwned?name"),  # clear screen, retitle
        ("two\nrows", "two?rows"),  # a forged table row
        ("abc\u202edcba", "abc?dcba"),  # a right-to-left override
        ("tab\there", "tab?here"),
        ("no\u00a0break", "no break"),
        ("ジョブ-é", "ジョブ-é"),  # printable text is left alone
    ],
)
def test_what_the_gateway_answered_cannot_drive_the_terminal(hostile: str, shown: str) -> None:
    stream = Terminal()
    out.columns(["name"], [[hostile]], stream=stream, title=hostile)
    assert stream.getvalue().splitlines()[0] == shown
    assert ANSI.sub("", stream.getvalue().splitlines()[2]) == shown


def test_an_error_keeps_its_lines_and_loses_escape_sequences(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out.error("the gateway said:\n\x1b[31mno\x1b[0m")
    assert capsys.readouterr().err == "error: the gateway said:\n?[31mno?[0m\n"


def test_a_header_is_cut_with_its_column(monkeypatch: pytest.MonkeyPatch) -> None:
    # 80 columns, the job list's eight: the cut columns end narrower than their headers, and
    # every header must still start where its column does.
    monkeypatch.setenv("COLUMNS", "80")
    stream = Terminal()
    row = ("j-0001-7f3a9c", "resnet-sweep", "vision/detect", "batch", "succeeded", "2x8")
    out.columns(
        ("job id", "name", "owner", "queue", "state", "accel", "cluster", "submitted"),
        [(*row, "onprem-h100", "2026-01-01 10:00:00")],
        keep=("job id", "state", "submitted"),
        stream=stream,
    )
    head, line = (ANSI.sub("", x) for x in stream.getvalue().splitlines())
    assert out.width_of(head) <= 80 and out.width_of(line) <= 80
    assert head.index("SUBMITTED") == line.index("2026-01-01")
    assert head.index("STATE") == line.index("succeeded")


@pytest.mark.parametrize(
    "value",
    [12345, "0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00", "yesterday"],
)
def test_a_time_that_cannot_be_shown_as_local_is_shown_as_it_came(value: object) -> None:
    assert out.when(value) == str(value)  # type: ignore[arg-type]


def test_marks_that_take_no_cell() -> None:
    assert out.width_of("กิ") == 1  # Thai: a consonant and a vowel sign above it
    assert out.width_of("कु") == 1  # Devanagari: a consonant and a vowel sign below it
