"""hcpasses: a torch.compile backend whose graph passes rewrite hyper-connection (HC) blocks."""
