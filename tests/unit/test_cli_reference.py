"""docs/reference.md's synopsis is the CLI: every option of every command is in it, and it
names no command the CLI does not have (read from typer's own command tree, no process)."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from moe_hang.cli import app

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference.md"


def _synopsis() -> dict[str, str]:
    text = DOC.read_text()
    block = text[text.index("## Commands"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    return {m.group(1): m.group(0) for m in re.finditer(
        r"^moe-hang (\w+)\s.*?(?=^moe-hang |\Z)", block, re.S | re.M)}


def test_every_option_of_every_command_is_in_the_synopsis() -> None:
    cli = typer.main.get_command(app)
    assert isinstance(cli, typer.core.TyperGroup)
    syn = _synopsis()
    assert set(syn) == set(cli.commands), "the synopsis and the CLI name other commands"
    missing: dict[str, list[str]] = {}
    for name, cmd in cli.commands.items():
        text = syn[name]
        # verify takes repro's options, and says so rather than repeating them
        if "the options of repro" in text:
            text += syn["repro"]
        for p in cmd.params:
            if p.param_type_name == "option" and p.opts:
                flag = max(p.opts, key=len)
                if not re.search(re.escape(flag) + r"(?![\w-])", text):
                    missing.setdefault(name, []).append(flag)
    assert not missing, f"options missing from docs/reference.md's synopsis: {missing}"


def test_the_synopsis_names_no_option_the_cli_lacks() -> None:
    cli = typer.main.get_command(app)
    assert isinstance(cli, typer.core.TyperGroup)
    gone: dict[str, list[str]] = {}
    for name, text in _synopsis().items():
        cmd = cli.commands[name]
        known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        if "the options of repro" in text:
            known |= {o for p in cli.commands["repro"].params
                      for o in (*p.opts, *p.secondary_opts)}
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text):
            if flag not in known:
                gone.setdefault(name, []).append(flag)
    assert not gone, f"docs/reference.md's synopsis names options the CLI lacks: {gone}"
