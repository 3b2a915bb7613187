"""Parameter-server machinery shared by `tfstrat.ParameterServer` (and `tfstrat.Hybrid`)."""
