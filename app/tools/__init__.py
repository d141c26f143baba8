"""Tool use through MCP (the Model Context Protocol): servers the user adds in Settings › Tools,
their tools offered to the model in conversations that turn tools on, and each call the model
makes shown and run only with the user's consent (``app.chat.tool_loop``)."""
