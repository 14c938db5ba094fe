"""flasync's tests: unit/ mirrors the packages, integration/ runs whole federations, processes and servers."""
