"""Transfer engines under the storage tier: one small interface, a backend per device kind."""
