"""``torch.distributed`` helpers below every other layer: collectives that release their inputs early and DTensor
local views. Imports nothing of the package."""
