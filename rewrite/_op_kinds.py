"""Kinds of TensorFlow ops the partitioner treats apart, by type name (TF 2.21's op registrations).

Kept apart from the rules that handle them, so that the rule registry
(``rules._base``), the rules (``rules._effects``, ``rules._random``) and the
propagation (``_propagation``) all read the same lists without importing each
other.
"""

from __future__ import annotations

# summary_ops.cc and logging_ops.cc: ops without outputs whose effect is outside the graph (once per step).
EFFECTS = ("WriteSummary", "WriteScalarSummary", "WriteHistogramSummary", "WriteImageSummary", "WriteAudioSummary",
           "WriteRawProtoSummary", "WriteGraphSummary", "PrintV2")

# random_ops.cc, stateful: a generator per op, seeded by the attributes seed and seed2.
STATEFUL_RANDOM = ("RandomUniform", "RandomStandardNormal", "TruncatedNormal", "RandomUniformInt", "RandomGamma",
                   "RandomPoissonV2", "Multinomial", "RandomShuffle", "ParameterizedTruncatedNormal")
