"""NCCL RAS read together with the rest of the evidence — pure (docs/DESIGN.md §13).

``reading`` (:func:`read_ras`): what the polls of one diagnosis say together — two polls a few
seconds apart compared (``compare`` + ``states`` → :class:`~.findings.RasFinding` s), else one
poll's own findings; ``counts``: the words every sentence built from launch counts uses (the
launch caveat: launches, not completions; no send/recv, so no all-to-all); ``failures``: dead,
unreachable or departed ranks and NCCL errors; ``launches``: frozen counts that disagree (the
ranks behind), moving counts, one poll's counts. The symmetric case — every rank in one
collective, RAS frozen at equal counts — is :mod:`moe_hang.analysis.transport`'s. Reading the
reports (files, a live job) is :mod:`moe_hang.evidence.ras` and :mod:`moe_hang.capture.ras`.
"""
