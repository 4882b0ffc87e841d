"""The Engram row store: table rows served from a hot-row cache and the tier that holds the tables."""
