"""Who may do what: node identities, session tickets, signed requests, and reading what peers wrote."""
