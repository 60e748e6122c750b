"""Tools built on the engine: the demo now; bench, tune and doctor later."""
