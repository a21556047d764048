"""What the gateway answered is shown by rich as text, never read as markup or passed on as
escape sequences: `qm status`, `qm watch` and `qm explain` of a job with a hostile name."""

from __future__ import annotations

import io

from rich.console import Console

from cli import render

HOSTILE = "[/] [red]x\x1b]0;pwned\x07\x1b[2J"


def shown(renderable: object) -> str:
    stream = io.StringIO()
    Console(file=stream, width=200, force_terminal=True, color_system=None).print(renderable)
    return stream.getvalue()


def test_a_job_view_shows_hostile_text_as_it_is_without_its_escapes() -> None:
    job = {
        "job_id": "j-1",
        "state": "queued",
        "name": HOSTILE,
        "message": HOSTILE,
        "history": [{"at": HOSTILE, "state": "queued", "event_type": HOSTILE, "message": HOSTILE}],
    }
    text = shown(render.job_view(job))  # a markup error would raise here
    assert "[/] [red]x?]0;pwned??[2J" in text
    assert "\x1b" not in text and "\x07" not in text


def test_event_lines_and_explanations_too() -> None:
    line = shown(render.event_line({"at": "x", "state": HOSTILE, "message": HOSTILE}))
    why = shown(render.explanation({"job_id": HOSTILE, "codes": [HOSTILE], "message": HOSTILE}))
    for text in (line, why):
        assert "[/] [red]x" in text
        assert "\x1b" not in text and "\x07" not in text
