"""The command line, the demo and the small GPT it trains."""
