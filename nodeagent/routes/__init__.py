"""The API's route tables over the domain: what each path and method answers, the domain
objects doing the work (nodeagent.api carries the requests and knows none of them)."""
