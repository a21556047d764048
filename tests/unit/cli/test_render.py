"""What the gateway answered is shown by rich as text, never read as markup or passed on as
escape sequences: `qm status`, `qm watch` and `qm explain` of a job with a hostile name."""

from __future__ import annotations

import inspect
import io
import re

from rich.console import Console
from rich.text import Text

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


def test_a_safe_table_shows_its_cells_and_title_as_text() -> None:
    table = render.SafeTable("name", "state", title=f"nodes of {HOSTILE}")
    table.add_row(HOSTILE, None)
    table.add_row("plain", Text(HOSTILE, style="red"))  # a Text made from a gateway value
    table.add_row("kept", Text("queued", style="cyan"))
    text = shown(table)  # a markup error would raise here
    # rich's Text drops the BEL itself; clean replaces the rest.
    assert text.count("[/] [red]x?]0;pwned?") == 3 and "plain" in text and "queued" in text
    assert "\x1b" not in text and "\x07" not in text


def test_the_gateway_commands_build_their_tables_safely() -> None:
    # Every table of the commands that show what the gateway answered is a SafeTable.
    import cli.fleet
    import cli.pools
    import cli.robots
    import cli.services
    import cli.usage

    for module in (cli.fleet, cli.pools, cli.robots, cli.services, cli.usage):
        source = inspect.getsource(module)
        assert re.search(r"(?<![A-Za-z_.])Table(\(|\.grid\()", source) is None, module.__name__
