pytest_plugins = ["tests.azurite"]
