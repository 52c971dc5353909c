"""Example apps used by the README, the demo, the Functions app and the tests."""
