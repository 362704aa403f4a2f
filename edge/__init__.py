"""tidegate edge: holds client connections, validates, relays chunk bytes."""
