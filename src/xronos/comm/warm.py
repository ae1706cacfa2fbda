"""Imported once by the process that workers are forked from (``forkserver``), so that each
worker starts with torch loaded and warm instead of importing it again — seconds per worker
on a small CPU. Importing this module is the whole effect."""

from __future__ import annotations

import torch
import torch._refs  # building a model on the meta device imports it lazily

# the first optimizer imports the compiler stack lazily; pay it here, not in a measurement
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
