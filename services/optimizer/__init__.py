"""The optimizer service. For now it only takes agent feedback and keeps it durably (issue 5 adds the optimizer)."""
