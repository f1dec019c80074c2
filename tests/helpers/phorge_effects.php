<?php

/**
 * What Phorge's work left and what its screens show, as the PHORGE_ROOT tests' helper
 * scripts read them (after scripts/init/init-script.php). tests/helpers/phorge_env.py
 * copies this file beside each helper script as helper.php.effects.php.
 */

// An object's effects: its feed stories, its search index rows, its transactions and
// the statuses of its mail, sorted.
function phorge_bridge_effects(PhabricatorUser $viewer, $phid) {
  $stories = id(new PhabricatorFeedQuery())->setViewer($viewer)
    ->withFilterPHIDs(array($phid))->execute();
  $ferret = id(new ManiphestTask())->newFerretEngine();
  $indexed = queryfx_one(id(new ManiphestTask())->establishConnection('r'),
    'SELECT COUNT(*) n FROM %T WHERE objectPHID = %s',
    $ferret->getDocumentTableName(), $phid);
  $xactions = id(new ManiphestTransactionQuery())->setViewer($viewer)
    ->withObjectPHIDs(array($phid))->execute();
  $statuses = array();
  foreach (id(new PhabricatorMetaMTAMail())->loadAllWhere('relatedPHID = %s', $phid)
    as $mail) {
    $statuses[] = $mail->getStatus();
  }
  sort($statuses);
  return array(
    'feedStories' => count($stories),
    'indexed' => (int)$indexed['n'],
    'transactions' => count($xactions),
    'mails' => $statuses,
  );
}

// The body FeedPublisherHTTPWorker::doWork() POSTs for a feed story.
function phorge_bridge_hook_body(PhabricatorFeedStory $story) {
  $data = $story->getStoryData();
  return http_build_query(
    array(
      'storyID' => $data->getID(),
      'storyType' => $data->getStoryType(),
      'storyData' => $data->getStoryData(),
      'storyAuthorPHID' => $data->getAuthorPHID(),
      'storyText' => $story->renderText(),
      'epoch' => $data->getEpoch(),
    ),
    '',
    '&');
}

// Phorge's Daemons console (/daemon/): the daemons its query calls alive, each with
// whether the console's list view shows it (its link).
function phorge_bridge_console(PhabricatorUser $viewer) {
  $logs = id(new PhabricatorDaemonLogQuery())->setViewer($viewer)
    ->withStatus(PhabricatorDaemonLogQuery::STATUS_ALIVE)->execute();
  $list = id(new PhabricatorDaemonLogListView())->setViewer($viewer)
    ->setDaemonLogs($logs);
  $html = hsprintf('%s', $list->render())->getHTMLContent();
  $out = array();
  foreach ($logs as $log) {
    $out[] = array(
      'daemon' => $log->getDaemon(),
      'host' => $log->getHost(),
      'pid' => (int)$log->getPID(),
      'status' => $log->getStatus(),
      'user' => $log->getRunningAsUser(),
      'argv' => $log->getArgv(),
      'shown' => strpos($html, '/daemon/log/'.$log->getID().'/') !== false,
    );
  }
  return $out;
}
