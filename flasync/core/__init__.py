"""The engine's ground floor: events, the bus, clocks, loops, instruments, errors and seeding."""
