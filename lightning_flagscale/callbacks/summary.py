"""``KnownFlopsRichModelSummary``: Lightning's Rich model summary without a ``FLOPs`` column that only says "0".

Lightning (>= 2.5) counts FLOPs by running ``example_input_array`` through the module under torch's FLOP counter.
Without that attribute (the built-in modules have none: their forward takes a batch dict, and a count on one rank
would be wrong under tensor or pipeline parallelism anyway) every row and the total read ``0``, which looks like a
measurement. This subclass drops the column and the total when the count is 0 and prints Lightning's table when it is
not. ``lightning-flagscale fit`` uses it in place of the Rich summary Lightning adds by default.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count
from typing_extensions import override

__all__ = ["KnownFlopsRichModelSummary"]

_LEFT = ("Name", "Type", "Mode")


class KnownFlopsRichModelSummary(RichModelSummary):
    """``RichModelSummary`` with no FLOPs column or total when the FLOPs are unknown (0)."""

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            RichModelSummary.summarize(
                summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, total_flops,
                **summarize_kwargs,
            )  # fmt: skip
            return
        from rich import get_console  # as Lightning's own: rich is needed only when a Rich summary prints
        from rich.table import Table

        data = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        table.add_column(" ", style="dim")
        for name, _ in data[1:]:
            table.add_column(name, justify="left" if name in _LEFT else "right")
        for row in zip(*(values for _, values in data)):
            table.add_row(*row)
        frozen = total_parameters - trainable_parameters
        grid = Table.grid(expand=True)
        grid.add_column()
        for label, value in (
            ("Trainable params", get_human_readable_count(int(trainable_parameters))),
            ("Non-trainable params", get_human_readable_count(int(frozen))),
            ("Total params", get_human_readable_count(int(total_parameters))),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", total_training_modes["train"]),
            ("Modules in eval mode", total_training_modes["eval"]),
        ):
            grid.add_row(f"[bold]{label}[/]: {value}")
        console = get_console()
        console.print(table)
        console.print(grid)
