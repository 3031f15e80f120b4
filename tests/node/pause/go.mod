module omnistage.test/pause

go 1.26.0
