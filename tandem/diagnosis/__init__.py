"""The doctor's rules, shared: thresholds, findings, knobs and the verdict.

``tandem doctor`` (tandem.tools.doctor) measures a server with probes from
outside and applies ``probe_rules.diagnose``; the server's dashboard
(tandem.entrypoints.server.dashboard) reads live figures from inside and applies
``live_rules.diagnose_live``. Both turn what they see into the same ``Finding``s
with the builders in ``findings``, so a problem reads the same, with the same
knob first, whichever found it. Pure functions of numbers, no HTTP and no
engine, nothing but the standard library: the server may import it, and every
rule is tested on synthetic numbers.
"""
