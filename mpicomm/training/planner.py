"""The bucket plan: which gradients share a bucket, and in what order buckets are reduced.

``plan_buckets`` groups gradients by key (family, dtype, device) under a byte cap or at
MindSpore's fusion split points, and lists the buckets in the order a backward pass
completes them.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from ..errors import invalid
from .context import check_fusion_config

MIB = 1 << 20


def check_bucket_cap_mb(cap):
    """Validate ``bucket_cap_mb``: a number of MiB >= 0, or None for no cap."""
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.integer, np.floating)) \
            or math.isnan(cap) or cap < 0:
        raise invalid("bucket_cap_mb", cap, "a number of MiB >= 0 (0: one all_reduce per tensor; "
                      "None or math.inf: one bucket per dtype and device)")
    return float(cap)


def plan_buckets(nbytes, keys=None, bucket_cap_mb=25.0, fusion_config=None, order=None):
    """The bucket plan: a list of buckets, each a sorted list of gradient indices.

    nbytes: the size of each gradient in bytes, in forward (registration) order.
    keys: what may share a bucket (e.g. (family, dtype, device)); None: all alike.
    bucket_cap_mb: greedy over the gradients in ``order``, a bucket is closed before
        it would pass the cap; a gradient as large as the cap or larger is a bucket of
        its own; 0 gives one bucket per gradient, None one per key.
    fusion_config: MindSpore split points (inclusive end indices, forward order), used
        instead of the cap; indices past the end are ignored with a warning.
    order: the gradient indices in the order a backward pass makes them ready (every
        index once); None: reverse registration order, n-1 down to 0. Only the cap uses
        it: the fusion_config's split points are in registration order.

    Buckets are listed in launch order: the one a backward pass completes first (in
    ``order``) first.
    """
    n = len(nbytes)
    keys = list(keys) if keys is not None else [None] * n
    if len(keys) != n:
        raise invalid("keys", f"{len(keys)} keys", f"one key per gradient ({n})")
    fusion_config = check_fusion_config(fusion_config)
    if order is None:
        order = range(n - 1, -1, -1)
    else:
        order = list(order)
        if sorted(order) != list(range(n)):
            raise invalid("order", f"{order[:10]}{'...' if len(order) > 10 else ''}",
                          f"every gradient index 0..{n - 1} once")
    pos = [0] * n
    for k, i in enumerate(order):
        pos[i] = k
    buckets = []
    if fusion_config is not None:
        past = [s for s in fusion_config if s >= n]
        if past:
            warnings.warn(f"fusion_config {fusion_config}: split point(s) {past} >= the number of "
                          f"gradients ({n}) are ignored", stacklevel=3)
        start = 0
        for end in [s for s in fusion_config if s < n] + [n - 1]:
            by_key = {}
            for i in range(start, end + 1):
                by_key.setdefault(keys[i], []).append(i)
            buckets.extend(by_key.values())
            start = end + 1
    else:
        cap = check_bucket_cap_mb(bucket_cap_mb)
        cap = math.inf if cap is None else cap * MIB
        open_ = {}  # key -> [indices, bytes]
        for i in order:
            k = keys[i]
            cur = open_.get(k)
            if cur is not None and cur[1] + nbytes[i] > cap:
                buckets.append(cur[0])
                cur = None
            if cur is None:
                cur = open_[k] = [[], 0]
            cur[0].append(i)
            cur[1] += nbytes[i]
            if cur[1] >= cap:
                buckets.append(cur[0])
                del open_[k]
        buckets.extend(c[0] for c in open_.values())
    buckets = [sorted(b) for b in buckets if b]
    buckets.sort(key=lambda b: max(pos[i] for i in b))  # (the order's last member completes it)
    return buckets
