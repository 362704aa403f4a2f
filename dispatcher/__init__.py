"""tidegate dispatcher: decides whether and when each request runs."""
