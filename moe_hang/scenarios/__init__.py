"""The MoE world the tool reproduces: the scenarios (a pure registry) and, inside the ranks
(torch), the model, the broken exchanges and their fixes, the worker and the reference.

The modules below ``registry`` import torch; nothing outside this package imports them except
through a rank (``python -m moe_hang.scenarios.worker``) or the public API."""
