"""What generated code calls at run time: mesh groups, collectives, gradient sync."""
