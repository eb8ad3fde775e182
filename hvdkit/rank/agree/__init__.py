"""The ranks' agreement: the same collective calls in the same order at the same step (lockstep),
the same weights (consistency), and which rank the others wait for (stragglers)."""
