"""Transports. Each module imports its SDK itself, so loading one never loads another's."""
