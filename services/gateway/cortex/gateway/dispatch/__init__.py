"""Running a routing decision against workers up to the first byte: the plan (pure), the attempt,
the dispatcher; prefill/decode in ``pd``.
"""
