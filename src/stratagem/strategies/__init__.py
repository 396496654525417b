"""One file per strategy; each overrides the hooks of :class:`stratagem.strategy.Strategy`."""
