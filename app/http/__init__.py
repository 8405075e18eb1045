"""What every router shares: the OpenAI error shape, its handlers, and the role dependency."""
