"""Acting on live ranks, always bounded: py-spy stacks and the probes' recorder dumps."""
