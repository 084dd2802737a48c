"""Transfer reference: tenant B cannot present a reference to tenant A's transferred KV."""
