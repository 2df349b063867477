"""Thresholds: each is the line between "fine" and "a user notices".

The doctor's probe rules and the live rules draw the same lines, and the
planner warns below the same reading speed (``READABLE_TOK_S``).
"""

TTFT_TARGET_S = 1.0  # a first token within about a second feels responsive in a chat
READABLE_TOK_S = 10.0  # below this, text types out slower than people read
GROWTH = 1.5  # TTFT "grows with the prompt" when the long prompt's is this many times the short's
QUEUE_S = 0.25  # a lone request that waited this long for a slot was queued behind others
KV_FULL = 0.9  # KV cache usage at or above this: the next request preempts or waits
STALL_S = 0.5  # a gap in a running stream this long is a visible stutter ...
STALL_FACTOR = 3.0  # ... when it is also this many times the stream's usual gap
CEILING_LOW = 0.5  # decode below this fraction of the bandwidth ceiling: time goes elsewhere
CEILING_HIGH = 1.3  # decode above this fraction of it: the ceiling's inputs are wrong
CONTEXT_DROP = 0.25  # decode this much slower at the long prompt: the KV read is visible
COLD_START_S = 1.0  # the first request paid this much more than later ones: a model load
