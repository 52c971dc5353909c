// Log Analytics workspace + workspace-based Application Insights.

@description('Azure region for the resources.')
param location string

@description('Tags applied to every resource.')
param tags object = {}

@description('Log Analytics workspace name.')
param workspaceName string

@description('Application Insights component name.')
param appInsightsName string

@description('Days Log Analytics keeps data (and so Application Insights, which is workspace-based).')
@minValue(30)
@maxValue(730)
param logRetentionDays int = 30

resource workspace 'Microsoft.OperationalInsights/workspaces@2023-09-01' = {
  name: workspaceName
  location: location
  tags: tags
  properties: {
    sku: {
      name: 'PerGB2018'
    }
    retentionInDays: logRetentionDays
  }
}

resource appInsights 'Microsoft.Insights/components@2020-02-02' = {
  name: appInsightsName
  location: location
  tags: tags
  kind: 'web'
  properties: {
    Application_Type: 'web'
    WorkspaceResourceId: workspace.id
    // Retention is governed by the workspace (logRetentionDays); ingestion stays public so the
    // Flex Consumption app can send telemetry without private networking.
    publicNetworkAccessForIngestion: 'Enabled'
    publicNetworkAccessForQuery: 'Enabled'
    // Entra ingestion only: the instrumentation key alone is not enough to send telemetry. The app
    // signs in with its identity (APPLICATIONINSIGHTS_AUTHENTICATION_STRING, Monitoring Metrics Publisher).
    DisableLocalAuth: true
  }
}

output workspaceId string = workspace.id
output appInsightsName string = appInsights.name
