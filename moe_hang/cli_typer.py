"""typer's rich help, two habits undone (the command classes ``moe_hang.cli`` uses)."""

from __future__ import annotations

from typing import Any

from typer.core import TyperArgument, TyperCommand, TyperGroup


class _PlainFlags:
    """typer's rich help, two habits undone.

    typer prints every parameter's ``display_type_rich()`` in its rich option panels — with
    ``rich_markup_mode="markdown"`` as with ``"rich"`` — flags included, so ``--json`` reads
    ``--json <bool>`` as if it took a value (its plain formatter skips flags; the rich one
    does not). An empty metavar makes the type column of a flag empty. And typer writes a
    required argument ``{pid}`` in the usage line; ``PID`` is what a person types."""

    def get_params(self, ctx: Any) -> list[Any]:
        params: list[Any] = super().get_params(ctx)  # type: ignore[misc]
        for p in params:
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""
        return params

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        metavar = getattr(self, "options_metavar", None)
        pieces = [metavar] if metavar else []
        for p in self.get_params(ctx):
            if isinstance(p, TyperArgument):
                name = p.metavar or (p.name or "").upper()
                pieces.append(name + ("..." if p.nargs != 1 else ""))
            else:
                pieces.extend(p.get_usage_pieces(ctx))
        return pieces


class _Command(_PlainFlags, TyperCommand):
    pass


class _Group(_PlainFlags, TyperGroup):
    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [*super().collect_usage_pieces(ctx), self.subcommand_metavar]
