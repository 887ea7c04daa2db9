"""An explicit-state model of flightcache's protocol, and its checker (docs/protocol.md,
"The model check"). Standard library only: ``python -m model``."""
