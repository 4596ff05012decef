"""Drafts: the EAGLE-3 head and its standard checkpoint layout, the drafters behind one interface (n-gram, EAGLE),
their state and captured graphs, and the adaptive tuner."""
